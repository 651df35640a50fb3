"""Grounded generation: does a short report invent figures or names not in its fact table?

`make_table(seed)` makes a fictional company's year (name, CEO, headquarters, headcount and,
per quarter, revenue, net profit and year-over-year revenue growth); `prompt_for` shows it as
markdown and asks for a 3-4 sentence report using only those figures. `extract_claims` pulls
every number and capitalised name out of the answer, `check_claims` marks each one supported
or contradicted, and `summarize` reports error rate = contradicted / claims made.

Numbers. Extracted: digits with optional currency ("$", "US$", "USD", "dollars"), scale
("million", "m", "bn", "k", ...) and percent ("%", "percent", "percentage points"); written
numbers ("four") are not. Money is converted to $ million. A number is supported if it is a
valid rounding of some figure of the same kind (money to money, percent to percent; a bare
number to anything): "$12 million" and "$12.40 million" both fit 12.4, "$12.38 million" (more
precision than the table shows) does not. Signs are ignored ("fell 3.1%" for -3.1 %).
Figures are the table's own plus these derivations: full-year totals and quarterly averages of
revenue and net profit, net margin (profit / revenue) per quarter and for the year,
quarter-over-quarter revenue change (% and $) and Q1 -> Q4 revenue change (% and $); bare
numbers may also be the fiscal year, the year before it (growth is year over year), the
headcount or 1-4 (quarters). A number preceded by "about", "around", "roughly", "nearly",
"almost", "approximately", "over", "more than", "under", "less than" is supported within 10 %.
A number is tied to a quarter when "in/for/during Qn" follows it directly, else to the
nearest earlier quarter mention in its sentence ("Q3", "third quarter") if no other number of
its kind comes between them; it must then match that quarter's figure or a full-year figure
("Q1 revenue of <Q3's revenue>" is contradicted).

Names. Extracted: runs of capitalised words, split at and trimmed of common words ("The",
"CEO", "Revenue", months...); a lone capitalised word that starts a sentence is skipped (it is
usually not a name); words with digits ("FY2023") are not names. Supported when its words
(possessive, common words and "Inc"/"Ltd"... dropped) are a contiguous part of the company,
CEO, city or country in the table ("Tanaka", "Kestrel"), a word may add up to 3 letters
("Australian", "Japanese"; but not "Canadian").

Known limits: a made-up number can coincide with a figure by chance (more likely for coarse
numbers: "$13 million" fits anything from 12.5 to 13.5); lower-case names, a sentence-initial
one-word name, and wrong statements without a number or name ("profit fell" when it rose) are
not seen; real-world places beyond the table's city and country count as contradicted; the
10 % band for approximate claims does not check direction; claims within one report are not
independent, so the claim-level interval is optimistic; `samples_with_error` is per report.
"""

from __future__ import annotations

import random
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvserve.evals.stats import wilson_interval

_COMPANY_A = ["Aster", "Bramble", "Corvid", "Dunmore", "Ember", "Fennick", "Galloway",
              "Halcyon", "Ironleaf", "Juniper", "Kestrel", "Larkspur", "Meridian", "Northwind",
              "Orrin", "Pellucid", "Quillon", "Redfern", "Solace", "Tamsin"]
_COMPANY_B = ["Analytics", "Robotics", "Foods", "Logistics", "Materials", "Biotech", "Software",
              "Energy", "Textiles", "Optics"]
_FIRST = ["Amara", "Bastian", "Celia", "Dorian", "Elif", "Farid", "Greta", "Hugo", "Ines",
          "Jonas", "Keiko", "Lucas", "Mira", "Nikolai", "Odile", "Priya", "Rafael", "Sofia",
          "Tomas", "Yara"]
_LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Castellano", "Novak", "Haddad", "Brennan",
         "Varga", "Achterberg", "Silvestri", "Kowalczyk", "Mbeki", "Ferreira", "Halvorsen",
         "Delacroix", "Ishikawa", "Quinlan", "Petrov", "Osei"]
_CITIES = [("Lisbon", "Portugal"), ("Toronto", "Canada"), ("Melbourne", "Australia"),
           ("Rotterdam", "Netherlands"), ("Osaka", "Japan"), ("Gothenburg", "Sweden"),
           ("Lyon", "France"), ("Munich", "Germany"), ("Valencia", "Spain"),
           ("Auckland", "New Zealand"), ("Montreal", "Canada"), ("Turin", "Italy"),
           ("Bergen", "Norway"), ("Tampere", "Finland"), ("Cork", "Ireland"),
           ("Aarhus", "Denmark"), ("Ghent", "Belgium"), ("Graz", "Austria"),
           ("Basel", "Switzerland"), ("Porto", "Portugal")]


@dataclass(frozen=True)
class QuarterFigures:
    """One quarter: $ million to one decimal, growth in % versus the same quarter a year ago."""

    quarter: int
    revenue_m: float
    net_profit_m: float
    growth_pct: float


@dataclass(frozen=True)
class FactTable:
    """A fictional company's fiscal year; every figure a report may use."""

    seed: int
    company: str
    ceo: str
    hq_city: str
    hq_country: str
    year: int
    headcount: int
    quarters: tuple[QuarterFigures, ...]

    def entities(self) -> tuple[str, ...]:
        return (self.company, self.ceo, self.hq_city, self.hq_country)

    def to_markdown(self) -> str:
        rows = [f"| Q{q.quarter} {self.year} | ${q.revenue_m:.1f} million "
                f"| ${q.net_profit_m:.1f} million | {q.growth_pct:+.1f}% |" for q in self.quarters]
        return "\n".join([
            "| Field | Value |", "| --- | --- |",
            f"| Company | {self.company} |", f"| CEO | {self.ceo} |",
            f"| Headquarters | {self.hq_city}, {self.hq_country} |",
            f"| Fiscal year | {self.year} |",
            f"| Headcount at year end | {self.headcount:,} |",
            "",
            "| Quarter | Revenue | Net profit | Revenue growth (year over year) |",
            "| --- | --- | --- | --- |",
            *rows,
        ])


def make_table(seed: int) -> FactTable:
    """A deterministic fictional company for `seed` (same seed, same table)."""
    rng = random.Random(seed)
    company = f"{rng.choice(_COMPANY_A)} {rng.choice(_COMPANY_B)}"
    ceo = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
    city, country = rng.choice(_CITIES)
    revenue = rng.uniform(5.0, 50.0)
    quarters = []
    for q in range(1, 5):
        rev = round(revenue, 1)
        profit = round(rev * rng.uniform(0.04, 0.22), 1)
        quarters.append(QuarterFigures(q, rev, profit, round(rng.uniform(-12.0, 35.0), 1)))
        revenue *= 1 + rng.uniform(-0.06, 0.15)
    return FactTable(seed, company, ceo, city, country, rng.randint(2018, 2024),
                     rng.randint(60, 2500), tuple(quarters))


def prompt_for(table: FactTable) -> list[dict[str, str]]:
    """Chat messages: the fact table as markdown and the request for a short report."""
    system = ("You are a financial analyst. Use only the facts you are given; do not add "
              "figures, names or places that are not in them.")
    user = (f"Facts about {table.company} for fiscal year {table.year}:\n\n"
            f"{table.to_markdown()}\n\n"
            "Write a short report (3-4 sentences) on the company's year. "
            "Use only the figures in the table.")
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


# --- figures -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Figure:
    """A value a report may state: kind "money" ($ million), "percent" or "plain"; `decimals`
    is the precision shown in the table (None: a derivation, exact to any precision)."""

    label: str
    value: float
    kind: str
    quarter: int | None = None
    decimals: int | None = None


def _pct(new: float, old: float) -> float:
    return (new - old) / old * 100 if old else 0.0


def table_figures(table: FactTable) -> list[Figure]:
    """The table's figures and the documented derivations."""
    qs = table.quarters
    figs = []
    for q in qs:
        n = q.quarter
        figs += [Figure(f"Q{n} revenue", q.revenue_m, "money", n, 1),
                 Figure(f"Q{n} net profit", q.net_profit_m, "money", n, 1),
                 Figure(f"Q{n} revenue growth", q.growth_pct, "percent", n, 1),
                 Figure(f"Q{n} net margin", q.net_profit_m / q.revenue_m * 100, "percent", n)]
    for prev, q in zip(qs, qs[1:], strict=False):
        figs += [Figure(f"Q{q.quarter} revenue change vs Q{prev.quarter}",
                        _pct(q.revenue_m, prev.revenue_m), "percent", q.quarter),
                 Figure(f"Q{q.quarter} revenue change vs Q{prev.quarter} ($)",
                        q.revenue_m - prev.revenue_m, "money", q.quarter)]
    rev, profit = sum(q.revenue_m for q in qs), sum(q.net_profit_m for q in qs)
    figs += [Figure("full-year revenue", rev, "money"),
             Figure("full-year net profit", profit, "money"),
             Figure("average quarterly revenue", rev / len(qs), "money"),
             Figure("average quarterly net profit", profit / len(qs), "money"),
             Figure("full-year net margin", profit / rev * 100, "percent"),
             Figure("Q1 to Q4 revenue change", _pct(qs[-1].revenue_m, qs[0].revenue_m),
                    "percent"),
             Figure("Q1 to Q4 revenue change ($)", qs[-1].revenue_m - qs[0].revenue_m, "money"),
             Figure("fiscal year", table.year, "plain", decimals=0),
             Figure("previous year", table.year - 1, "plain", decimals=0),
             Figure("headcount", table.headcount, "plain", decimals=0)]
    figs += [Figure(f"quarter number {n}", n, "plain", decimals=0) for n in range(1, 5)]
    return figs


# --- claims ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Claim:
    """A concrete statement found in a report: a number (`value` in $ million for kind
    "money") or a name (`value` None, kind "entity")."""

    kind: str  # "money" | "percent" | "plain" | "entity"
    text: str
    start: int
    value: float | None = None
    decimals: int = 0
    quarter: int | None = None
    approx: bool = False


@dataclass(frozen=True)
class ClaimVerdict:
    """A claim's verdict and why (the matching figure or name, or what failed)."""

    claim: Claim
    verdict: str  # "supported" | "contradicted"
    reason: str


_NUMBER = re.compile(
    r"(?<![\w.$])(?P<cur>US\$|\$|USD\s?)?"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?:\s?(?P<scale>million|billion|thousand|mln|mn|bn|m|b|k)\b)?"
    r"(?:\s?(?P<pct>%|percent\b|per cent\b|percentage points?\b))?"
    r"(?:\s?(?P<cur2>dollars\b|USD\b))?",
    re.IGNORECASE,
)
_SCALE_M = {"million": 1.0, "mln": 1.0, "mn": 1.0, "m": 1.0, "billion": 1e3, "bn": 1e3,
            "b": 1e3, "thousand": 1e-3, "k": 1e-3}
_SCALE_DIGITS = {1.0: 0, 1e3: -3, 1e-3: 3}  # decimals gained when converting to $ million
_QUARTER = re.compile(r"\bQ([1-4])\b|\b(first|second|third|fourth|final|last)[\s-]+quarter\b"
                      r"|\bquarter\s+([1-4])\b", re.IGNORECASE)
_QUARTER_WORDS = {"first": 1, "second": 2, "third": 3, "fourth": 4, "final": 4, "last": 4}
_AFTER_QUARTER = re.compile(r"\s*(?:in|for|during|of)\s+(?:the\s+)?(?=\S)", re.IGNORECASE)
_APPROX = re.compile(r"\b(?:about|around|roughly|nearly|almost|approximately|approx\.?|over|"
                     r"more than|under|less than|close to|some)\s*$", re.IGNORECASE)
_SENTENCE_END = re.compile(r"[.!?](?=\s)|\n")


def _sentence_start(text: str, pos: int) -> int:
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, pos)]
    return ends[-1] if ends else 0


def _quarter_of(m: re.Match[str]) -> int:
    if m.group(1) or m.group(3):
        return int(m.group(1) or m.group(3))
    return _QUARTER_WORDS[m.group(2).lower()]


def _bind_quarter(text: str, claim: Claim, end: int, others: list[Claim]) -> Claim:
    """"$X in Q1" -> Q1; else the nearest quarter mention earlier in the same sentence, unless
    another number of the same kind comes between ("Q4 revenue fell to $X from $Y": $Y is
    left unbound)."""
    after = _AFTER_QUARTER.match(text, end)
    q = _QUARTER.match(text, after.end()) if after else None
    if q is None:
        before = list(_QUARTER.finditer(text, _sentence_start(text, claim.start), claim.start))
        blocked = before and any(o.kind == claim.kind and before[-1].end() <= o.start
                                 < claim.start for o in others)
        q = before[-1] if before and not blocked else None
    return replace(claim, quarter=_quarter_of(q)) if q else claim


def _number_claim(text: str, m: re.Match[str]) -> Claim:
    raw = m.group("num").replace(",", "")
    value = float(raw)
    decimals = len(raw.split(".")[1]) if "." in raw else 0
    scale = (m.group("scale") or "").lower()
    currency = bool(m.group("cur") or m.group("cur2"))
    if m.group("pct"):
        kind = "percent"
    elif scale:
        kind, value = "money", value * _SCALE_M[scale]
        decimals += _SCALE_DIGITS[_SCALE_M[scale]]
    elif currency:  # raw dollars: "$12,400,000"
        kind, value, decimals = "money", value / 1e6, decimals + 6
    else:
        kind = "plain"
    approx = _APPROX.search(text, 0, m.start()) is not None
    return Claim(kind, m.group().strip(), m.start(), value, decimals, None, approx)


# Capitalised words that are not names (compared lower-case, after dropping "'s").
_COMMON_WORDS = """
a an the in on at by for with from to of and or but as after before during while although
despite under over through across into overall meanwhile however also both all each every
its it this that these those his her their our we i he she they
company firm revenue revenues net profit profits growth margin quarter quarters
quarterly year years annual fiscal full total report summary highlights outlook
ceo cfo coo chief executive officer president founder headquarters headquartered based hq
headcount staff employees workforce team q1 q2 q3 q4 fy yoy qoq usd eps ebitda gaap
strong solid steady record first second third fourth final last mr ms mrs dr
looking ahead notably additionally furthermore moreover finally conclusion key results
january february march april may june july august september october november december
monday tuesday wednesday thursday friday saturday sunday
"""
_COMMON = frozenset(_COMMON_WORDS.split())
_CORPORATE = frozenset({"inc", "ltd", "llc", "plc", "corp", "corporation", "co", "group",
                        "gmbh", "ag", "sa"})
_WORD = re.compile(r"(?<![\w'\u2019-])[^\W\d_][\w'\u2019-]*")  # not "M" in "12.4M"


def _name_tokens(word: str) -> list[str]:
    """"Osaka-based" -> ["osaka", "based"]; "Tanaka's" -> ["tanaka"]; accents folded."""
    w = unicodedata.normalize("NFKD", word)
    w = "".join(c for c in w if not unicodedata.combining(c)).lower()
    w = re.sub(r"['\u2019]s?$", "", w)
    return [t for t in w.split("-") if t]


def _capitalised_runs(text: str) -> list[list[re.Match[str]]]:
    """Maximal runs of capitalised words separated only by spaces."""
    runs: list[list[re.Match[str]]] = []
    prev_end = -1
    for m in _WORD.finditer(text):
        if not m.group()[0].isupper():
            prev_end = -1
            continue
        if runs and prev_end >= 0 and text[prev_end:m.start()] in (" ", "\u00a0"):
            runs[-1].append(m)
        else:
            runs.append([m])
        prev_end = m.end()
    return runs


def _is_name_word(word: str) -> bool:
    return not any(c.isdigit() for c in word) and not all(
        t in _COMMON for t in _name_tokens(word))


def _entity_claims(text: str) -> list[Claim]:
    claims = []
    for run in _capitalised_runs(text):
        before = text[_sentence_start(text, run[0].start()):run[0].start()]
        opens_sentence = not before.strip(" \t*-#>\"'(")
        parts: list[list[re.Match[str]]] = [[]]
        for m in run:  # split the run at common words
            if _is_name_word(m.group()):
                parts[-1].append(m)
            else:
                parts.append([])
        for part in parts:
            if not part or (len(part) == 1 and part[0] is run[0] and opens_sentence):
                continue  # nothing left, or a lone capitalised sentence opener
            start, end = part[0].start(), part[-1].end()
            claims.append(Claim("entity", text[start:end], start))
    return claims


def extract_claims(text: str) -> list[Claim]:
    """Every number and capitalised name in `text`, in order of appearance."""
    matches = list(_NUMBER.finditer(text))
    numbers = [_number_claim(text, m) for m in matches]
    numbers = [_bind_quarter(text, c, m.end(), numbers) for c, m in zip(numbers, matches,
                                                                         strict=True)]
    return sorted(numbers + _entity_claims(text), key=lambda c: c.start)


def _fits(claim: Claim, fig: Figure) -> bool:
    """Is the claim a valid rounding of the figure (signs ignored)?"""
    assert claim.value is not None
    target, value = abs(fig.value), abs(claim.value)
    if claim.approx:
        return abs(value - target) <= 0.1 * target + 1e-9
    if fig.decimals is not None and claim.decimals > fig.decimals:
        return abs(value - target) < 1e-9  # more precision than shown: must be exact
    return abs(value - target) <= 0.5 * 10.0 ** -claim.decimals + 1e-9


def _check_number(claim: Claim, figures: list[Figure]) -> ClaimVerdict:
    same_kind = [f for f in figures if claim.kind == "plain" or f.kind == claim.kind]
    fits = [f for f in same_kind if _fits(claim, f)]
    ok = [f for f in fits if claim.quarter is None or f.quarter in (None, claim.quarter)]
    if ok:
        return ClaimVerdict(claim, "supported", ok[0].label)
    if fits:
        return ClaimVerdict(claim, "contradicted",
                            f"matches {fits[0].label}, not a Q{claim.quarter} figure")
    return ClaimVerdict(claim, "contradicted", "no table figure or derivation matches")


def _same(token: str, known: str) -> bool:
    """Equal, or `known` plus a short suffix ("Australian", "Japanese", "Kestrels")."""
    return token == known or (len(known) >= 4 and token.startswith(known)
                              and len(token) - len(known) <= 3)


def _check_entity(claim: Claim, table: FactTable) -> ClaimVerdict:
    words = [t for w in claim.text.split() for t in _name_tokens(w)]
    words = [t for t in words if t not in _CORPORATE and t not in _COMMON] or words
    for name in table.entities():
        known = [t for w in name.split() for t in _name_tokens(w)]
        if any(all(_same(w, k) for w, k in zip(words, known[i:i + len(words)], strict=True))
               for i in range(len(known) - len(words) + 1)):
            return ClaimVerdict(claim, "supported", name)
    return ClaimVerdict(claim, "contradicted", "name not in the table")


def check_claims(claims: Sequence[Claim], table: FactTable) -> list[ClaimVerdict]:
    """A verdict for each claim against the table (rules in the module docstring)."""
    figures = table_figures(table)
    return [_check_entity(c, table) if c.kind == "entity" else _check_number(c, figures)
            for c in claims]


def score_response(text: str, table: FactTable) -> list[ClaimVerdict]:
    """`check_claims(extract_claims(text), table)`."""
    return check_claims(extract_claims(text), table)


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson_interval(k, n)
    return {"value": k / n if n else 0.0, "ci95": [lo, hi]}


def summarize(samples: Sequence[Sequence[ClaimVerdict]]) -> dict[str, Any]:
    """Claim counts over reports; error_rate = contradicted / claims made (Wilson 95 %), plus
    the same split by numbers and names, and the share of reports with any contradiction."""
    flat = [v for s in samples for v in s]
    bad = [v for v in flat if v.verdict == "contradicted"]
    numbers = [v for v in flat if v.claim.kind != "entity"]
    entities = [v for v in flat if v.claim.kind == "entity"]
    n_bad_numbers = sum(v.verdict == "contradicted" for v in numbers)
    with_error = sum(any(v.verdict == "contradicted" for v in s) for s in samples)
    return {
        "samples": len(samples), "claims": len(flat), "contradicted": len(bad),
        "supported": len(flat) - len(bad),
        "claims_per_sample": len(flat) / len(samples) if samples else 0.0,
        "error_rate": _rate(len(bad), len(flat)),
        "number_error_rate": _rate(n_bad_numbers, len(numbers)),
        "entity_error_rate": _rate(len(bad) - n_bad_numbers, len(entities)),
        "samples_with_error": _rate(with_error, len(samples)),
    }
