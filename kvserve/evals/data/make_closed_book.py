"""Regenerate `closed_book.jsonl`: closed-book QA questions with short, unambiguous answers.

Every fact is a stable, structured public fact (ISO 3166 country capitals, the IUPAC periodic
table, the SI brochure's units and exact conversion factors, the order of the planets,
authorship of classic books, ...), written down by hand here so that the data set is
reviewable as code. Each question lists every answer alias that should be accepted; grading
(`kvserve/evals/factuality/closed_book.py`) also folds case, accents, punctuation, articles and
number
formats, so aliases only need to cover real spelling variants ("Kyiv" / "Kiev"), symbols
("Au" / "gold"), surnames ("Austen") and number words ("eight" / "8").

Facts whose answer is disputed, has several official values or changed recently are left
out (e.g. the capitals of Bolivia, South Africa, the Netherlands, Sri Lanka, Kazakhstan,
Indonesia, Sudan; continents of transcontinental countries; currencies shared by name between
countries are only accepted when qualified). No answer alias may appear inside its own
question (a restatement would otherwise grade as correct); the test suite checks this.

    .venv/bin/python kvserve/evals/data/make_closed_book.py            # rewrite the file next to
    this
    .venv/bin/python kvserve/evals/data/make_closed_book.py --check    # exit 1 if the file would
    change
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).with_name("closed_book.jsonl")

# (country as asked, capital aliases). Only countries with one undisputed capital.
CAPITALS: list[tuple[str, list[str]]] = [
    # Europe
    ("France", ["Paris"]),
    ("Germany", ["Berlin"]),
    ("Italy", ["Rome", "Roma"]),
    ("Spain", ["Madrid"]),
    ("Portugal", ["Lisbon", "Lisboa"]),
    ("the United Kingdom", ["London"]),
    ("Ireland", ["Dublin"]),
    ("Belgium", ["Brussels", "Bruxelles", "Brussel"]),
    ("Austria", ["Vienna", "Wien"]),
    ("Switzerland", ["Bern", "Berne"]),
    ("Poland", ["Warsaw", "Warszawa"]),
    ("the Czech Republic (Czechia)", ["Prague", "Praha"]),
    ("Slovakia", ["Bratislava"]),
    ("Hungary", ["Budapest"]),
    ("Romania", ["Bucharest", "București"]),
    ("Bulgaria", ["Sofia"]),
    ("Greece", ["Athens", "Athína"]),
    ("Serbia", ["Belgrade", "Beograd"]),
    ("Croatia", ["Zagreb"]),
    ("Slovenia", ["Ljubljana"]),
    ("Bosnia and Herzegovina", ["Sarajevo"]),
    ("North Macedonia", ["Skopje"]),
    ("Albania", ["Tirana", "Tiranë"]),
    ("Montenegro", ["Podgorica"]),
    ("Denmark", ["Copenhagen", "København"]),
    ("Norway", ["Oslo"]),
    ("Sweden", ["Stockholm"]),
    ("Finland", ["Helsinki"]),
    ("Iceland", ["Reykjavík"]),
    ("Estonia", ["Tallinn"]),
    ("Latvia", ["Riga"]),
    ("Lithuania", ["Vilnius"]),
    ("Ukraine", ["Kyiv", "Kiev"]),
    ("Belarus", ["Minsk"]),
    ("Russia", ["Moscow", "Moskva"]),
    ("Moldova", ["Chișinău", "Chisinau", "Kishinev"]),
    ("Malta", ["Valletta"]),
    ("Cyprus", ["Nicosia", "Lefkosia"]),
    ("Liechtenstein", ["Vaduz"]),
    # Asia
    ("China", ["Beijing", "Peking"]),
    ("Japan", ["Tokyo"]),
    ("South Korea", ["Seoul"]),
    ("North Korea", ["Pyongyang"]),
    ("Mongolia", ["Ulaanbaatar", "Ulan Bator"]),
    ("Vietnam", ["Hanoi", "Ha Noi"]),
    ("Thailand", ["Bangkok"]),
    ("Laos", ["Vientiane"]),
    ("Cambodia", ["Phnom Penh"]),
    ("the Philippines", ["Manila"]),
    ("Myanmar", ["Naypyidaw", "Nay Pyi Taw", "Naypyitaw"]),
    ("India", ["New Delhi"]),
    ("Pakistan", ["Islamabad"]),
    ("Bangladesh", ["Dhaka", "Dacca"]),
    ("Nepal", ["Kathmandu"]),
    ("Bhutan", ["Thimphu"]),
    ("Afghanistan", ["Kabul"]),
    ("Iran", ["Tehran", "Teheran"]),
    ("Iraq", ["Baghdad"]),
    ("Syria", ["Damascus"]),
    ("Jordan", ["Amman"]),
    ("Lebanon", ["Beirut"]),
    ("Saudi Arabia", ["Riyadh"]),
    ("Oman", ["Muscat"]),
    ("the United Arab Emirates", ["Abu Dhabi"]),
    ("Qatar", ["Doha"]),
    ("Bahrain", ["Manama"]),
    ("Turkey", ["Ankara"]),
    ("the country of Georgia", ["Tbilisi"]),
    ("Armenia", ["Yerevan"]),
    ("Azerbaijan", ["Baku"]),
    ("Uzbekistan", ["Tashkent"]),
    ("Turkmenistan", ["Ashgabat", "Ashkhabad"]),
    ("Kyrgyzstan", ["Bishkek"]),
    ("Tajikistan", ["Dushanbe"]),
    ("the Maldives", ["Malé"]),
    # Africa
    ("Egypt", ["Cairo"]),
    ("Libya", ["Tripoli"]),
    ("Tunisia", ["Tunis"]),
    ("Algeria", ["Algiers"]),
    ("Morocco", ["Rabat"]),
    ("Ethiopia", ["Addis Ababa"]),
    ("Kenya", ["Nairobi"]),
    ("Uganda", ["Kampala"]),
    ("Rwanda", ["Kigali"]),
    ("Ghana", ["Accra"]),
    ("Senegal", ["Dakar"]),
    ("Mali", ["Bamako"]),
    ("Niger", ["Niamey"]),
    ("Nigeria", ["Abuja"]),
    ("Cameroon", ["Yaoundé"]),
    ("Angola", ["Luanda"]),
    ("Zambia", ["Lusaka"]),
    ("Zimbabwe", ["Harare"]),
    ("Mozambique", ["Maputo"]),
    ("Madagascar", ["Antananarivo"]),
    ("Namibia", ["Windhoek"]),
    ("Botswana", ["Gaborone"]),
    ("Somalia", ["Mogadishu"]),
    ("the Democratic Republic of the Congo", ["Kinshasa"]),
    ("the Republic of the Congo", ["Brazzaville"]),
    ("Gabon", ["Libreville"]),
    ("Guinea", ["Conakry"]),
    ("Sierra Leone", ["Freetown"]),
    ("Liberia", ["Monrovia"]),
    ("Burkina Faso", ["Ouagadougou"]),
    ("Chad", ["N'Djamena", "Ndjamena"]),
    ("Eritrea", ["Asmara"]),
    ("Malawi", ["Lilongwe"]),
    ("Mauritania", ["Nouakchott"]),
    ("Togo", ["Lomé"]),
    # Americas
    ("the United States", ["Washington, D.C.", "Washington DC", "Washington"]),
    ("Canada", ["Ottawa"]),
    ("Mexico", ["Mexico City", "Ciudad de México"]),
    ("Cuba", ["Havana", "La Habana"]),
    ("Jamaica", ["Kingston"]),
    ("Haiti", ["Port-au-Prince"]),
    ("the Dominican Republic", ["Santo Domingo"]),
    ("Honduras", ["Tegucigalpa"]),
    ("El Salvador", ["San Salvador"]),
    ("Nicaragua", ["Managua"]),
    ("Costa Rica", ["San José"]),
    ("Belize", ["Belmopan"]),
    ("Colombia", ["Bogotá"]),
    ("Venezuela", ["Caracas"]),
    ("Ecuador", ["Quito"]),
    ("Peru", ["Lima"]),
    ("Brazil", ["Brasília"]),
    ("Argentina", ["Buenos Aires"]),
    ("Chile", ["Santiago", "Santiago de Chile"]),
    ("Uruguay", ["Montevideo"]),
    ("Paraguay", ["Asunción"]),
    ("Guyana", ["Georgetown"]),
    ("Suriname", ["Paramaribo"]),
    ("Trinidad and Tobago", ["Port of Spain"]),
    ("the Bahamas", ["Nassau"]),
    ("Barbados", ["Bridgetown"]),
    # Oceania
    ("Australia", ["Canberra"]),
    ("New Zealand", ["Wellington"]),
    ("Fiji", ["Suva"]),
    ("Papua New Guinea", ["Port Moresby"]),
    ("Samoa", ["Apia"]),
    ("Tonga", ["Nuku'alofa"]),
    ("the Solomon Islands", ["Honiara"]),
    ("Vanuatu", ["Port Vila"]),
]

# (atomic number, symbol, name aliases), IUPAC names first.
ELEMENTS: list[tuple[int, str, list[str]]] = [
    (1, "H", ["hydrogen"]), (2, "He", ["helium"]), (3, "Li", ["lithium"]),
    (4, "Be", ["beryllium"]), (5, "B", ["boron"]), (6, "C", ["carbon"]),
    (7, "N", ["nitrogen"]), (8, "O", ["oxygen"]), (9, "F", ["fluorine"]),
    (10, "Ne", ["neon"]), (11, "Na", ["sodium"]), (12, "Mg", ["magnesium"]),
    (13, "Al", ["aluminium", "aluminum"]), (14, "Si", ["silicon"]),
    (15, "P", ["phosphorus"]), (16, "S", ["sulfur", "sulphur"]), (17, "Cl", ["chlorine"]),
    (18, "Ar", ["argon"]), (19, "K", ["potassium"]), (20, "Ca", ["calcium"]),
    (21, "Sc", ["scandium"]), (22, "Ti", ["titanium"]), (23, "V", ["vanadium"]),
    (24, "Cr", ["chromium"]), (25, "Mn", ["manganese"]), (26, "Fe", ["iron"]),
    (27, "Co", ["cobalt"]), (28, "Ni", ["nickel"]), (29, "Cu", ["copper"]),
    (30, "Zn", ["zinc"]), (35, "Br", ["bromine"]), (36, "Kr", ["krypton"]),
    (47, "Ag", ["silver"]), (50, "Sn", ["tin"]), (51, "Sb", ["antimony"]),
    (53, "I", ["iodine"]), (54, "Xe", ["xenon"]), (55, "Cs", ["caesium", "cesium"]),
    (74, "W", ["tungsten", "wolfram"]), (78, "Pt", ["platinum"]), (79, "Au", ["gold"]),
    (80, "Hg", ["mercury"]), (82, "Pb", ["lead"]), (86, "Rn", ["radon"]),
    (88, "Ra", ["radium"]), (92, "U", ["uranium"]), (94, "Pu", ["plutonium"]),
]
# Which elements get which question (symbol from name, name from symbol, atomic number).
SYMBOL_FROM_NAME = [n for n in range(1, 31)] + [47, 50, 53, 54, 74, 78, 79, 80, 82, 92]
NAME_FROM_SYMBOL = [2, 10, 11, 18, 19, 26, 27, 28, 29, 30, 36, 47, 50, 51, 54, 55, 74, 79, 80,
                    82, 86]
ATOMIC_NUMBER = [n for n in range(1, 21)] + [26, 29, 30, 35, 47, 50, 53, 78, 79, 80, 82, 88,
                                             92, 94]

# Solar system: (id suffix, question, answers).
SOLAR_SYSTEM: list[tuple[str, str, list[str]]] = [
    ("largest-planet", "What is the largest planet in the Solar System?", ["Jupiter"]),
    ("smallest-planet", "What is the smallest planet in the Solar System?", ["Mercury"]),
    ("closest-to-sun", "Which planet is closest to the Sun?", ["Mercury"]),
    ("second-from-sun", "Which planet is second from the Sun?", ["Venus"]),
    ("third-from-sun", "Which planet is third from the Sun?", ["Earth"]),
    ("fifth-from-sun", "Which planet is fifth from the Sun?", ["Jupiter"]),
    ("sixth-from-sun", "Which planet is sixth from the Sun?", ["Saturn"]),
    ("seventh-from-sun", "Which planet is seventh from the Sun?", ["Uranus"]),
    ("farthest-planet", "Which planet is farthest from the Sun?", ["Neptune"]),
    ("red-planet", "Which planet is known as the Red Planet?", ["Mars"]),
    ("hottest-planet", "Which planet has the hottest average surface temperature?", ["Venus"]),
    ("planet-count", "How many planets are in the Solar System?", ["8", "eight"]),
    ("great-red-spot", "Which planet has the storm known as the Great Red Spot?", ["Jupiter"]),
    ("olympus-mons", "On which planet is the volcano Olympus Mons?", ["Mars"]),
    ("on-its-side", "Which planet's axis of rotation is tilted so that it spins on its side?",
     ["Uranus"]),
    ("ring-system", "Which planet is best known for its large, bright ring system?", ["Saturn"]),
    ("largest-moon", "What is the largest moon in the Solar System?", ["Ganymede"]),
    ("largest-moon-saturn", "What is the largest moon of Saturn?", ["Titan"]),
    ("largest-moon-neptune", "What is the largest moon of Neptune?", ["Triton"]),
    ("volcanic-moon", "Which moon of Jupiter is the most volcanically active body in the Solar "
     "System?", ["Io"]),
    ("dwarf-2006", "Which former ninth planet was reclassified as a dwarf planet in 2006?",
     ["Pluto"]),
    ("asteroid-belt", "What is the largest object in the main asteroid belt?", ["Ceres"]),
    ("earth-moons", "How many natural moons does Earth have?", ["1", "one"]),
    ("our-galaxy", "What is the name of the galaxy that contains the Solar System?",
     ["Milky Way"]),
]

# (book, author aliases): full name first, then a surname alone where it is unambiguous.
AUTHORS: list[tuple[str, list[str]]] = [
    ("Pride and Prejudice", ["Jane Austen", "Austen"]),
    ("Sense and Sensibility", ["Jane Austen", "Austen"]),
    ("Emma (the 1815 novel)", ["Jane Austen", "Austen"]),
    ("Moby-Dick", ["Herman Melville", "Melville"]),
    ("War and Peace", ["Leo Tolstoy", "Lev Tolstoy", "Tolstoy"]),
    ("Anna Karenina", ["Leo Tolstoy", "Lev Tolstoy", "Tolstoy"]),
    ("Crime and Punishment", ["Fyodor Dostoevsky", "Dostoevsky", "Dostoyevsky"]),
    ("The Brothers Karamazov", ["Fyodor Dostoevsky", "Dostoevsky", "Dostoyevsky"]),
    ("Don Quixote", ["Miguel de Cervantes", "Cervantes"]),
    ("Hamlet", ["William Shakespeare", "Shakespeare"]),
    ("Macbeth", ["William Shakespeare", "Shakespeare"]),
    ("Romeo and Juliet", ["William Shakespeare", "Shakespeare"]),
    ("Great Expectations", ["Charles Dickens", "Dickens"]),
    ("A Tale of Two Cities", ["Charles Dickens", "Dickens"]),
    ("Oliver Twist", ["Charles Dickens", "Dickens"]),
    ("Jane Eyre", ["Charlotte Brontë"]),
    ("Wuthering Heights", ["Emily Brontë"]),
    ("Frankenstein", ["Mary Shelley", "Mary Wollstonecraft Shelley"]),
    ("Dracula", ["Bram Stoker", "Stoker"]),
    ("The Adventures of Tom Sawyer", ["Mark Twain", "Twain", "Samuel Clemens"]),
    ("Adventures of Huckleberry Finn", ["Mark Twain", "Twain", "Samuel Clemens"]),
    ("The Odyssey", ["Homer"]),
    ("The Iliad", ["Homer"]),
    ("The Divine Comedy", ["Dante Alighieri", "Dante"]),
    ("Les Misérables", ["Victor Hugo", "Hugo"]),
    ("The Hunchback of Notre-Dame", ["Victor Hugo", "Hugo"]),
    ("Madame Bovary", ["Gustave Flaubert", "Flaubert"]),
    ("The Count of Monte Cristo", ["Alexandre Dumas", "Dumas"]),
    ("The Three Musketeers", ["Alexandre Dumas", "Dumas"]),
    ("Nineteen Eighty-Four", ["George Orwell", "Orwell", "Eric Arthur Blair"]),
    ("Animal Farm", ["George Orwell", "Orwell", "Eric Arthur Blair"]),
    ("Brave New World", ["Aldous Huxley", "Huxley"]),
    ("The Great Gatsby", ["F. Scott Fitzgerald", "Scott Fitzgerald", "Fitzgerald"]),
    ("To Kill a Mockingbird", ["Harper Lee"]),
    ("The Scarlet Letter", ["Nathaniel Hawthorne", "Hawthorne"]),
    ("Little Women", ["Louisa May Alcott", "Alcott"]),
    ("Treasure Island", ["Robert Louis Stevenson", "Stevenson"]),
    ("Strange Case of Dr Jekyll and Mr Hyde", ["Robert Louis Stevenson", "Stevenson"]),
    ("The Picture of Dorian Gray", ["Oscar Wilde", "Wilde"]),
    ("Gulliver's Travels", ["Jonathan Swift", "Swift"]),
    ("Robinson Crusoe", ["Daniel Defoe", "Defoe"]),
    ("Ulysses (the 1922 novel)", ["James Joyce", "Joyce"]),
    ("The Metamorphosis", ["Franz Kafka", "Kafka"]),
    ("The Trial (the novel published in 1925)", ["Franz Kafka", "Kafka"]),
    ("Alice's Adventures in Wonderland", ["Lewis Carroll", "Carroll", "Charles Dodgson",
                                          "Charles Lutwidge Dodgson"]),
    ("The Time Machine", ["H. G. Wells", "Herbert George Wells", "Wells"]),
    ("The War of the Worlds", ["H. G. Wells", "Herbert George Wells", "Wells"]),
    ("Twenty Thousand Leagues Under the Seas", ["Jules Verne", "Verne"]),
    ("Around the World in Eighty Days", ["Jules Verne", "Verne"]),
    ("The Call of the Wild", ["Jack London"]),
    ("The Jungle Book", ["Rudyard Kipling", "Kipling"]),
    ("Heart of Darkness", ["Joseph Conrad", "Conrad"]),
    ("Middlemarch", ["George Eliot", "Mary Ann Evans"]),
    ("Of Mice and Men", ["John Steinbeck", "Steinbeck"]),
    ("The Grapes of Wrath", ["John Steinbeck", "Steinbeck"]),
    ("The Old Man and the Sea", ["Ernest Hemingway", "Hemingway"]),
    ("The Hobbit", ["J. R. R. Tolkien", "Tolkien"]),
    ("The Lord of the Rings", ["J. R. R. Tolkien", "Tolkien"]),
    ("One Hundred Years of Solitude", ["Gabriel García Márquez", "García Márquez"]),
    ("Things Fall Apart", ["Chinua Achebe", "Achebe"]),
    ("The Canterbury Tales", ["Geoffrey Chaucer", "Chaucer"]),
    ("Paradise Lost", ["John Milton", "Milton"]),
    ("The Prince (Il Principe)", ["Niccolò Machiavelli", "Machiavelli"]),
    ("Candide", ["Voltaire"]),
    ("Walden", ["Henry David Thoreau", "Thoreau"]),
    ("Leaves of Grass", ["Walt Whitman", "Whitman"]),
    ("The Raven (the 1845 poem)", ["Edgar Allan Poe", "Poe"]),
    ("Uncle Tom's Cabin", ["Harriet Beecher Stowe", "Beecher Stowe"]),
    ("A Study in Scarlet", ["Arthur Conan Doyle", "Conan Doyle"]),
    ("On the Origin of Species", ["Charles Darwin", "Darwin"]),
    ("Fahrenheit 451", ["Ray Bradbury", "Bradbury"]),
    ("Lord of the Flies", ["William Golding", "Golding"]),
    ("Catch-22", ["Joseph Heller", "Heller"]),
    ("The Catcher in the Rye", ["J. D. Salinger", "Salinger"]),
]

# SI units: (quantity as asked, base?, unit name, symbol or None). The symbol "A" (ampere) is
# left out: it is an article and normalises away.
SI_UNITS: list[tuple[str, bool, str, str | None]] = [
    ("length", True, "metre", "m"),
    ("mass", True, "kilogram", "kg"),
    ("time", True, "second", "s"),
    ("electric current", True, "ampere", None),
    ("thermodynamic temperature", True, "kelvin", "K"),
    ("amount of substance", True, "mole", "mol"),
    ("luminous intensity", True, "candela", "cd"),
    ("force", False, "newton", "N"),
    ("energy", False, "joule", "J"),
    ("power", False, "watt", "W"),
    ("pressure", False, "pascal", "Pa"),
    ("frequency", False, "hertz", "Hz"),
    ("electric charge", False, "coulomb", "C"),
    ("electric potential difference (voltage)", False, "volt", "V"),
    ("electrical resistance", False, "ohm", "Ω"),
    ("capacitance", False, "farad", "F"),
    ("magnetic flux density", False, "tesla", "T"),
    ("magnetic flux", False, "weber", "Wb"),
    ("inductance", False, "henry", "H"),
    ("electrical conductance", False, "siemens", "S"),
    ("radioactive activity", False, "becquerel", "Bq"),
    ("absorbed dose of ionising radiation", False, "gray", "Gy"),
    ("illuminance", False, "lux", "lx"),
    ("luminous flux", False, "lumen", "lm"),
]
UNIT_EXTRA_ALIASES = {"metre": ["meter", "meters"], "ampere": ["amp", "amps"],
                      "henry": ["henries"]}
NO_PLURAL = {"siemens", "hertz", "lux"}

# Exact conversions and defined values: (id suffix, question, number as text, extra aliases).
# Integers up to 100 also accept their English words ("sixty").
CONVERSIONS: list[tuple[str, str, str, list[str]]] = [
    ("cm-per-m", "How many centimetres are in one metre?", "100", []),
    ("mm-per-m", "How many millimetres are in one metre?", "1000", ["one thousand"]),
    ("m-per-km", "How many metres are in one kilometre?", "1000", ["one thousand"]),
    ("g-per-kg", "How many grams are in one kilogram?", "1000", ["one thousand"]),
    ("ml-per-l", "How many millilitres are in one litre?", "1000", ["one thousand"]),
    ("s-per-min", "How many seconds are in one minute?", "60", []),
    ("min-per-h", "How many minutes are in one hour?", "60", []),
    ("s-per-h", "How many seconds are in one hour?", "3600", []),
    ("h-per-day", "How many hours are in one day?", "24", []),
    ("min-per-day", "How many minutes are in one day?", "1440", []),
    ("s-per-day", "How many seconds are in one day?", "86400", []),
    ("days-leap-year", "How many days are in a leap year of the Gregorian calendar?", "366", []),
    ("in-per-ft", "How many inches are in one foot?", "12", []),
    ("ft-per-yd", "How many feet are in one yard?", "3", []),
    ("ft-per-mi", "How many feet are in one statute mile?", "5280", []),
    ("yd-per-mi", "How many yards are in one statute mile?", "1760", []),
    ("cm-per-in", "How many centimetres are in one inch, exactly?", "2.54", []),
    ("oz-per-lb", "How many avoirdupois ounces are in one pound?", "16", []),
    ("lb-per-st", "How many pounds are in one stone?", "14", []),
    ("bits-per-byte", "How many bits are in one byte (octet)?", "8", []),
    ("freeze-c", "At what temperature in degrees Celsius does pure water freeze at standard "
     "atmospheric pressure?", "0", []),
    ("boil-c", "At what temperature in degrees Celsius does pure water boil at standard "
     "atmospheric pressure?", "100", []),
    ("freeze-f", "At what temperature in degrees Fahrenheit does pure water freeze at standard "
     "atmospheric pressure?", "32", []),
    ("boil-f", "At what temperature in degrees Fahrenheit does pure water boil at standard "
     "atmospheric pressure?", "212", []),
    ("abs-zero-c", "What is absolute zero in degrees Celsius?", "-273.15", ["minus 273.15"]),
    ("abs-zero-k", "What is absolute zero in kelvins?", "0", []),
    ("right-angle", "How many degrees are in a right angle?", "90", []),
    ("full-circle", "How many degrees are in a full circle?", "360", []),
    ("triangle-angles", "What is the sum of the interior angles of a triangle in degrees?",
     "180", []),
    ("marathon-km", "How many kilometres long is a marathon, exactly?", "42.195", []),
    ("speed-of-light", "What is the speed of light in a vacuum in metres per second, exactly?",
     "299792458", []),
]

# Continent of a country: only countries wholly on one continent under every usual convention.
CONTINENTS: list[tuple[str, str]] = [
    ("Kenya", "Africa"), ("Nigeria", "Africa"), ("Ghana", "Africa"), ("Morocco", "Africa"),
    ("Ethiopia", "Africa"), ("Angola", "Africa"),
    ("Brazil", "South America"), ("Argentina", "South America"), ("Peru", "South America"),
    ("Chile", "South America"), ("Colombia", "South America"),
    ("Japan", "Asia"), ("India", "Asia"), ("Thailand", "Asia"), ("Vietnam", "Asia"),
    ("Mongolia", "Asia"), ("South Korea", "Asia"),
    ("Canada", "North America"), ("Mexico", "North America"),
    ("France", "Europe"), ("Germany", "Europe"), ("Norway", "Europe"), ("Poland", "Europe"),
    ("Portugal", "Europe"),
]

# "...on the South American continent" answers the question too
CONTINENT_ADJECTIVES = {"Africa": "African", "South America": "South American", "Asia": "Asian",
                        "North America": "North American", "Europe": "European"}

# Currency of a country: (country, aliases). A bare name shared with other countries' currencies
# ("krone", "riyal") is only accepted for the country best known by it.
CURRENCIES: list[tuple[str, list[str]]] = [
    ("Japan", ["yen", "Japanese yen", "JPY"]),
    ("the United Kingdom", ["pound sterling", "pound", "sterling", "British pound", "GBP"]),
    ("the United States", ["United States dollar", "US dollar", "dollar", "American dollar",
                           "USD"]),
    ("India", ["Indian rupee", "rupee", "INR"]),
    ("China", ["renminbi", "yuan", "RMB", "CNY"]),
    ("Russia", ["ruble", "rouble", "Russian ruble", "RUB"]),
    ("Switzerland", ["Swiss franc", "franc", "CHF"]),
    ("Mexico", ["Mexican peso", "peso", "MXN"]),
    ("South Africa", ["rand", "South African rand", "ZAR"]),
    ("Sweden", ["Swedish krona", "SEK"]),
    ("Poland", ["złoty", "zloty", "Polish zloty", "PLN"]),
    ("Turkey", ["Turkish lira", "lira"]),
    ("Germany", ["euro", "EUR"]),
    ("Italy", ["euro", "EUR"]),
    ("Thailand", ["baht", "Thai baht", "THB"]),
    ("Vietnam", ["đồng", "dong", "Vietnamese dong", "VND"]),
    ("Saudi Arabia", ["Saudi riyal", "riyal", "SAR"]),
    ("Nigeria", ["naira", "Nigerian naira", "NGN"]),
    ("Kenya", ["Kenyan shilling", "KES"]),
    ("Indonesia", ["rupiah", "Indonesian rupiah", "IDR"]),
    ("Denmark", ["Danish krone", "DKK"]),
    ("Hungary", ["forint", "Hungarian forint", "HUF"]),
    ("Brazil", ["real", "Brazilian real", "reais", "BRL"]),
    ("South Korea", ["South Korean won", "won", "KRW"]),
    ("Israel", ["new shekel", "shekel", "new Israeli shekel", "sheqel", "ILS"]),
]

# Other stable facts: (id suffix, category, question, answers).
MISC: list[tuple[str, str, str, list[str]]] = [
    ("largest-ocean", "geography", "What is the largest ocean on Earth?", ["Pacific",
                                                                          "Pacific Ocean"]),
    ("highest-mountain", "geography", "What is the highest mountain on Earth above sea level?",
     ["Mount Everest", "Everest", "Sagarmatha", "Chomolungma", "Qomolangma"]),
    ("largest-hot-desert", "geography", "What is the largest hot desert on Earth?",
     ["Sahara", "Sahara Desert"]),
    ("water-formula", "science", "What is the chemical formula of water?", ["H2O"]),
    ("salt-formula", "science", "What is the chemical formula of sodium chloride?", ["NaCl"]),
    ("atmosphere-gas", "science", "Which gas makes up most of Earth's atmosphere by volume?",
     ["nitrogen", "N2"]),
    ("hardest-mineral", "science", "What is the hardest naturally occurring mineral?",
     ["diamond"]),
    ("adult-bones", "science", "How many bones are in the typical adult human skeleton?",
     ["206"]),
    ("chromosomes", "science", "How many chromosomes are in a typical human body cell?",
     ["46", "23 pairs"]),
    ("longest-bone", "science", "What is the longest bone in the human body?",
     ["femur", "thigh bone", "thighbone"]),
    ("largest-animal", "science", "What is the largest animal alive today?",
     ["blue whale"]),
    ("octopus-hearts", "science", "How many hearts does an octopus have?", ["3", "three"]),
    ("smallest-prime", "math", "What is the smallest prime number?", ["2", "two"]),
    ("pi-2dp", "math", "What is pi rounded to two decimal places?", ["3.14"]),
    ("sqrt-144", "math", "What is the square root of 144?", ["12", "twelve"]),
    ("two-pow-ten", "math", "What is 2 raised to the power of 10?", ["1024"]),
    ("hexagon-sides", "math", "How many sides does a hexagon have?", ["6", "six"]),
    ("octagon-sides", "math", "How many sides does an octagon have?", ["8", "eight"]),
    ("piano-keys", "misc", "How many keys does a standard modern piano have?", ["88"]),
    ("chessboard-squares", "misc", "How many light and dark squares does a standard chessboard "
     "have in total?", ["64", "sixty-four"]),
    ("deck-cards", "misc", "How many cards are in a standard deck of playing cards, without "
     "jokers?", ["52", "fifty-two"]),
    ("soccer-players", "misc", "How many players does one association football (soccer) team "
     "have on the field at a time?", ["11", "eleven"]),
    ("apollo-11", "history", "In what year did Apollo 11 land on the Moon?", ["1969"]),
    ("ww2-end", "history", "In what year did World War II end?", ["1945"]),
    ("berlin-wall", "history", "In what year did the Berlin Wall fall?", ["1989"]),
    ("first-moonwalker", "history", "Who was the first person to walk on the Moon?",
     ["Neil Armstrong", "Armstrong"]),
    ("first-in-space", "history", "Who was the first human to travel into space?",
     ["Yuri Gagarin", "Gagarin"]),
    ("relativity", "science", "Who developed the general theory of relativity?",
     ["Albert Einstein", "Einstein"]),
    ("penicillin", "science", "Who discovered penicillin in 1928?",
     ["Alexander Fleming", "Fleming"]),
    ("laws-of-motion", "science", "Who formulated the three classical laws of motion published "
     "in the Principia?", ["Isaac Newton", "Newton"]),
    ("periodic-table", "science", "Which Russian chemist published the periodic table of the "
     "elements in 1869?", ["Dmitri Mendeleev", "Mendeleev", "Mendeleyev"]),
    ("mona-lisa", "art", "Who painted the Mona Lisa?",
     ["Leonardo da Vinci", "Leonardo", "da Vinci"]),
    ("starry-night", "art", "Who painted The Starry Night?", ["Vincent van Gogh", "van Gogh"]),
    ("sistine-ceiling", "art", "Who painted the ceiling of the Sistine Chapel?",
     ["Michelangelo", "Michelangelo Buonarroti"]),
    ("moonlight-sonata", "music", "Who composed the Moonlight Sonata?",
     ["Ludwig van Beethoven", "Beethoven"]),
    ("magic-flute", "music", "Who composed the opera The Magic Flute?",
     ["Wolfgang Amadeus Mozart", "Mozart"]),
]

_ONES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
         "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
         "eighteen", "nineteen"]
_TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]


def number_words(n: int) -> str:
    """English words for 0 <= n <= 100 ("seventy-nine")."""
    if n < 20:
        return _ONES[n]
    if n == 100:
        return "one hundred"
    tens, ones = divmod(n, 10)
    return _TENS[tens] + (f"-{_ONES[ones]}" if ones else "")


def _number_answers(n: int) -> list[str]:
    return [str(n), number_words(n)] if n <= 100 else [str(n)]


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _q(id_: str, category: str, question: str, answers: list[str]) -> dict:
    return {"id": id_, "category": category, "question": question, "answers": answers}


def _capitals() -> list[dict]:
    return [_q(f"capital-{_slug(c.removeprefix('the '))}", "capitals",
               f"What is the capital of {c}?", a) for c, a in CAPITALS]


def _elements() -> list[dict]:
    by_z = {z: (sym, names) for z, sym, names in ELEMENTS}
    out = []
    for z in SYMBOL_FROM_NAME:
        sym, names = by_z[z]
        out.append(_q(f"symbol-{names[0]}", "element_symbols",
                      f"What is the chemical symbol of the element {names[0]}?", [sym]))
    for z in NAME_FROM_SYMBOL:
        sym, names = by_z[z]
        out.append(_q(f"element-{sym.lower()}", "element_names",
                      f"Which chemical element has the symbol {sym}?", names))
    for z in ATOMIC_NUMBER:
        sym, names = by_z[z]
        out.append(_q(f"atomic-number-{names[0]}", "atomic_numbers",
                      f"What is the atomic number of {names[0]}?", _number_answers(z)))
    return out


def _units() -> list[dict]:
    out = []
    for quantity, base, name, symbol in SI_UNITS:
        aliases = [name] + ([] if name in NO_PLURAL else [name + "s"])
        aliases += UNIT_EXTRA_ALIASES.get(name, []) + ([symbol] if symbol else [])
        kind = "base unit" if base else "unit"
        out.append(_q(f"si-unit-{_slug(quantity)}", "si_units",
                      f"What is the SI {kind} of {quantity}?", aliases))
    for suffix, question, number, extra in CONVERSIONS:
        words = _number_answers(int(number))[1:] if number.isdigit() else []
        words = [w for w in words if w not in question]  # "absolute zero" asks for 0 only
        out.append(_q(f"convert-{suffix}", "units_conversions", question,
                      [number] + words + extra))
    return out


def build_items() -> list[dict]:
    """Every question, in file order."""
    items = _capitals() + _elements()
    items += [_q(f"solar-{s}", "solar_system", q, a) for s, q, a in SOLAR_SYSTEM]
    items += [_q(f"author-{_slug(book)}", "authors", f"Who wrote {book}?", a)
              for book, a in AUTHORS]
    items += _units()
    items += [_q(f"continent-{_slug(c)}", "continents",
                 f"On which continent is {c} located?", [a, f"{CONTINENT_ADJECTIVES[a]} continent"])
              for c, a in CONTINENTS]
    items += [_q(f"currency-{_slug(c.removeprefix('the '))}", "currencies",
                 f"What is the official currency of {c}?", a) for c, a in CURRENCIES]
    items += [_q(f"{cat}-{s}", cat, q, a) for s, cat, q, a in MISC]
    ids = [i["id"] for i in items]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise SystemExit(f"duplicate ids: {dupes}")
    return items


def render(items: list[dict]) -> str:
    return "".join(json.dumps(i, ensure_ascii=False) + "\n" for i in items)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file would change")
    args = parser.parse_args(argv)
    text = render(build_items())
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT} is out of date: run {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {len(build_items())} questions to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
