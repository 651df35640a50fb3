"""Factuality eval: dataset, normalisation, abstention, grading, scoring (pure logic, no model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvserve.evals.factuality import closed_book as cb
from kvserve.evals.factuality import grounded as gr
from kvserve.evals.stats import wilson_interval

DATA = Path(cb.__file__).resolve().parents[1] / "data"


# --- dataset -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def items() -> list[cb.QAItem]:
    return cb.load_dataset()


def test_shipped_dataset_loads(items: list[cb.QAItem]) -> None:
    assert len(items) >= 300
    assert len({i.id for i in items}) == len(items)
    assert all(i.question.strip() and i.answers for i in items)
    assert all(cb.normalize(a) for i in items for a in i.answers)
    assert len({i.category for i in items}) >= 8


def test_shipped_dataset_matches_its_generator() -> None:
    spec = importlib.util.spec_from_file_location("make_closed_book",
                                                  DATA / "make_closed_book.py")
    assert spec is not None and spec.loader is not None
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render(gen.build_items()) == (DATA / "closed_book.jsonl").read_text("utf-8")


def test_every_alias_grades_correct_and_none_leaks_into_its_question(
        items: list[cb.QAItem]) -> None:
    for item in items:
        q = cb.normalize(item.question).split()
        for alias in item.answers:
            a = cb.normalize(alias).split()
            leaks = any(q[i:i + len(a)] == a for i in range(len(q) - len(a) + 1))
            assert not leaks, (item.id, alias)  # a restated question would grade correct
            assert cb.grade(alias, item.answers) == "correct", (item.id, alias)
            assert cb.grade(f"The answer is {alias}.", item.answers) == "correct", (item.id,
                                                                                   alias)


def test_spot_check_gold_answers(items: list[cb.QAItem]) -> None:
    by_id = {i.id: i for i in items}
    assert cb.grade("Canberra", by_id["capital-australia"].answers) == "correct"
    assert cb.grade("Sydney", by_id["capital-australia"].answers) == "incorrect"
    assert cb.grade("Au", by_id["symbol-gold"].answers) == "correct"
    assert cb.grade("79", by_id["atomic-number-gold"].answers) == "correct"
    assert cb.grade("Washington, D.C.", by_id["capital-united-states"].answers) == "correct"
    assert cb.grade("eight", by_id["solar-planet-count"].answers) == "correct"


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "mine.jsonl"
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def test_user_dataset(tmp_path: Path) -> None:
    p = _write(tmp_path, [json.dumps({"question": "2+2?", "answers": ["4", "four"]}), "",
                          json.dumps({"id": "x", "question": "Q?", "answers": ["A b"],
                                      "category": "c"})])
    got = cb.load_dataset(p)
    assert [(i.id, i.category) for i in got] == [("line-1", "custom"), ("x", "c")]
    assert got[0].answers == ["4", "four"]


@pytest.mark.parametrize(("line", "field"), [
    ({"answers": ["x"]}, "question"),
    ({"question": 3, "answers": ["x"]}, "question"),
    ({"question": "Q?"}, "answers"),
    ({"question": "Q?", "answers": []}, "answers"),
    ({"question": "Q?", "answers": "Paris"}, "answers"),
    ({"question": "Q?", "answers": ["ok", 7]}, "answers"),
    ({"question": "Q?", "answers": ["  "]}, "answers"),
    ({"id": 5, "question": "Q?", "answers": ["x"]}, "id"),
])
def test_bad_line_names_line_and_field(tmp_path: Path, line: dict, field: str) -> None:
    good = json.dumps({"question": "Fine?", "answers": ["yes"]})
    p = _write(tmp_path, [good, good.replace("Fine", "Also"), json.dumps(line)])
    with pytest.raises(ValueError, match=rf"mine\.jsonl:3: field '{field}'"):
        cb.load_dataset(p)


def test_bad_json_and_duplicate_ids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mine\.jsonl:2: not valid JSON"):
        cb.load_dataset(_write(tmp_path, ['{"question": "a", "answers": ["b"]}', "{oops"]))
    dup = json.dumps({"id": "d", "question": "a", "answers": ["b"]})
    with pytest.raises(ValueError, match=r"mine\.jsonl:2: field 'id'"):
        cb.load_dataset(_write(tmp_path, [dup, dup]))
    with pytest.raises(ValueError, match="expected a JSON object"):
        cb.load_dataset(_write(tmp_path, ["[1, 2]"]))


def test_prompt_for() -> None:
    msgs = cb.prompt_for(cb.QAItem("x", "What is the capital of France?", ["Paris"]))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "I don't know" in msgs[0]["content"] and "shortest" in msgs[0]["content"]
    assert msgs[1]["content"] == "What is the capital of France?"


# --- normalisation, abstention, grading -------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("Paris.", "paris"),
    ("  The   Eiffel Tower ", "eiffel tower"),
    ("Theodore", "theodore"),  # articles are removed as whole words only
    ("Anna and the king", "anna and king"),
    ("a an the", ""),
    ("1,000", "1000"), ("1 000", "1000"), ("1,000,000", "1000000"), ("1\u202f000", "1000"),
    ("79.0", "79"), ("2.540", "2.54"), ("3.14", "3.14"),
    ("-273.15", "-273.15"), ("\u2212273.15", "-273.15"),
    ("Washington, D.C.", "washington dc"),
    ("Bogotá", "bogota"), ("N\u2019Djamena", "ndjamena"), ("H\u2082O", "h2o"),
    ("seventy-nine", "seventy nine"), ("Port-au-Prince", "port au prince"),
    ("I don't know", "i dont know"),
    ("1969, 1970", "1969 1970"),
])
def test_normalize(text: str, expected: str) -> None:
    assert cb.normalize(text) == expected


@pytest.mark.parametrize("text", [
    "", "   ", "I don't know", "I don't know.", "I do not know the answer.", "I'm not sure.",
    "I am not sure", "Not sure", "I cannot answer that.", "I can't answer this question.",
    "Unknown", "unknown.", "No idea", "I'm sorry, but I don't know.", "N/A", "?",
    "I'm unable to answer", "I don't have that information.",
])
def test_abstentions(text: str) -> None:
    assert cb.is_abstention(text)
    assert cb.grade(text, ["Paris"]) == "not_attempted"


@pytest.mark.parametrize("text", [
    "Paris", "Lyon", "I'm not sure, but I think it is Paris.", "Probably Lyon",
    "Paris. I'm not completely sure though.", "Na", "None", "I",
])
def test_not_abstentions(text: str) -> None:
    assert not cb.is_abstention(text)


@pytest.mark.parametrize(("response", "answers", "expected"), [
    ("Paris", ["Paris"], "correct"),
    ("paris.", ["Paris"], "correct"),
    ("Paris, France", ["Paris"], "correct"),
    ("The capital of France is Paris.", ["Paris"], "correct"),
    ("I'm not sure, but I think it's Paris.", ["Paris"], "correct"),
    ("Lyon", ["Paris"], "incorrect"),
    ("Paris or Lyon", ["Paris"], "incorrect"),
    ("Either Paris or Lyon.", ["Paris"], "incorrect"),
    ("Paris/Lyon", ["Paris"], "incorrect"),
    ("It is not Paris.", ["Paris"], "incorrect"),
    ("Parisian", ["Paris"], "incorrect"),
    ("I don't know", ["Paris"], "not_attempted"),
    ("1,000", ["1000"], "correct"),
    ("1000", ["1,000"], "correct"),
    ("About 1 000 metres.", ["1000"], "correct"),
    ("The answer is 79.", ["79"], "correct"),
    ("Gold has atomic number 79, and its mass is 196.97.", ["79"], "correct"),
    ("1979", ["79"], "incorrect"),
    ("79.5", ["79"], "incorrect"),
    ("78 or 79", ["79"], "incorrect"),
    ("Seventy-nine", ["79", "seventy-nine"], "correct"),
    ("Seventy-nine", ["79"], "incorrect"),  # number words only through aliases
    ("There are 8 planets.", ["8", "eight"], "correct"),
    ("299,792,458 m/s", ["299792458"], "correct"),
    ("-273.15 °C", ["-273.15"], "correct"),
    ("273.15", ["-273.15"], "incorrect"),
    ("Washington, D.C.", ["Washington, D.C.", "Washington DC", "Washington"], "correct"),
    ("Washington DC", ["Washington, D.C."], "correct"),
    ("Kiev", ["Kyiv", "Kiev"], "correct"),
    ("Bogota", ["Bogotá"], "correct"),
    ("Jane Austen", ["Jane Austen", "Austen"], "correct"),
    ("J.R.R. Tolkien", ["J. R. R. Tolkien", "Tolkien"], "correct"),
    ("Gold", ["Au", "gold"], "correct"),
    ("The symbol for iodine is I.", ["I"], "correct"),
    ("I think it's Fe", ["I"], "incorrect"),  # one-letter aliases only as the last token
    ("Theodore Roosevelt", ["Theodore Roosevelt"], "correct"),
    ("Roosevelt", ["Theodore Roosevelt"], "incorrect"),
])
def test_grade(response: str, answers: list[str], expected: str) -> None:
    assert cb.grade(response, answers) == expected


# --- closed-book scores ------------------------------------------------------------------------


def test_summarize_known_counts() -> None:
    grades = ["correct"] * 50 + ["incorrect"] * 30 + ["not_attempted"] * 20
    s = cb.summarize(grades)
    assert (s["n"], s["correct"], s["incorrect"], s["not_attempted"], s["attempted"]) == (
        100, 50, 30, 20, 80)
    assert s["correct_rate"]["value"] == pytest.approx(0.5)
    assert s["not_attempted_rate"]["value"] == pytest.approx(0.2)
    assert s["accuracy_given_attempted"]["value"] == pytest.approx(50 / 80)
    assert s["factual_error_rate"]["value"] == pytest.approx(30 / 80)
    assert s["hallucination_rate"]["value"] == pytest.approx(0.3)
    assert s["f1"]["value"] == pytest.approx(2 * 0.5 * 0.625 / 1.125)
    assert s["factual_error_rate"]["ci95"] == pytest.approx(list(wilson_interval(30, 80)))
    assert s["hallucination_rate"]["ci95"] == pytest.approx(list(wilson_interval(30, 100)))
    for key in ("correct_rate", "accuracy_given_attempted", "factual_error_rate", "f1"):
        lo, hi = s[key]["ci95"]
        assert lo < s[key]["value"] < hi
    assert cb.summarize(grades) == s  # the F1 bootstrap is seeded


def test_summarize_edges() -> None:
    s = cb.summarize(["not_attempted"] * 4)
    assert s["attempted"] == 0 and s["f1"]["value"] == 0.0
    assert s["factual_error_rate"] == {"value": 0.0, "ci95": [0.0, 1.0]}
    assert cb.summarize([])["n"] == 0
    perfect = cb.summarize(["correct"] * 10)
    assert perfect["f1"]["value"] == 1.0 and perfect["f1"]["ci95"] == [1.0, 1.0]
    with pytest.raises(ValueError, match="unknown grades"):
        cb.summarize(["right"])


# --- grounded generation ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def table() -> gr.FactTable:
    return gr.make_table(7)


def test_make_table_is_deterministic() -> None:
    assert gr.make_table(3) == gr.make_table(3)
    assert gr.make_table(3) != gr.make_table(4)
    assert len({gr.make_table(s).company for s in range(40)}) > 10
    for s in range(40):
        t = gr.make_table(s)
        assert [q.quarter for q in t.quarters] == [1, 2, 3, 4]
        assert all(q.revenue_m > q.net_profit_m > 0 for q in t.quarters)


def test_prompt_shows_the_table(table: gr.FactTable) -> None:
    msgs = gr.prompt_for(table)
    assert [m["role"] for m in msgs] == ["system", "user"]
    user = msgs[1]["content"]
    q1 = table.quarters[0]
    for text in (table.company, table.ceo, table.hq_city, f"${q1.revenue_m:.1f} million",
                 f"{table.headcount:,}", "3-4 sentences", "Use only the figures in the table"):
        assert text in user


def _faithful_report(t: gr.FactTable) -> str:
    q = t.quarters
    total = sum(x.revenue_m for x in q)
    profit = sum(x.net_profit_m for x in q)
    return (
        f"{t.company} closed fiscal {t.year} with revenue of ${total:.1f} million across "
        f"four quarters. Revenue moved from ${q[0].revenue_m:.1f} million in Q1 to "
        f"${q[3].revenue_m:.1f} million in Q4, and full-year net profit reached "
        f"${profit:.1f} million, a net margin of about {profit / total * 100:.0f}%. "
        f"In the fourth quarter, revenue changed {abs(q[3].growth_pct):.1f}% year over year "
        f"compared with {t.year - 1}, while Q2 net profit was ${q[1].net_profit_m:.1f}M. "
        f"CEO {t.ceo} leads the {t.hq_city}-based team of {t.headcount:,} employees in "
        f"{t.hq_country}; {t.ceo.split()[-1]}'s plan kept {t.company.split()[0]} on track.")


def test_faithful_report_has_no_contradictions(table: gr.FactTable) -> None:
    for seed in (table.seed, 1, 2, 3, 11):
        t = gr.make_table(seed)
        verdicts = gr.score_response(_faithful_report(t), t)
        bad = [(v.claim.text, v.reason) for v in verdicts if v.verdict == "contradicted"]
        assert bad == [], (seed, bad)
        kinds = [v.claim.kind for v in verdicts]
        assert kinds.count("entity") >= 5 and kinds.count("money") >= 5
        assert "percent" in kinds and "plain" in kinds


def test_invented_figures_and_names_are_contradicted(table: gr.FactTable) -> None:
    q = table.quarters
    report = (f"{table.company} grew revenue to $987.6 million, up 123.4% on the year. "
              f"CFO John Smith opened a new office in Berlin. "
              f"Q1 revenue was ${q[2].revenue_m:.1f} million. "
              f"Headcount reached {table.headcount + 1111:,} while CEO {table.ceo} stayed.")
    verdicts = gr.score_response(report, table)
    got = {v.claim.text: v.verdict for v in verdicts}
    for invented in ("$987.6 million", "123.4%", "John Smith", "Berlin",
                     f"${q[2].revenue_m:.1f} million", f"{table.headcount + 1111:,}"):
        assert got[invented] == "contradicted", invented
    assert got[table.company] == "supported" and got[table.ceo] == "supported"
    wrong_quarter = next(v for v in verdicts if v.claim.text.startswith(f"${q[2].revenue_m:.1f}"))
    assert "Q3 revenue" in wrong_quarter.reason and wrong_quarter.claim.quarter == 1


def test_extract_number_formats() -> None:
    text = ("Revenue was $12,400,000 in Q1, $13.1m in Q2. Also 1.2 billion dollars, USD 5.5 "
            "million, 8.2 percent, 3.5% and 1,240 staff; Q4 was $14 million. FY2023 results.")
    numbers = [c for c in gr.extract_claims(text) if c.kind != "entity"]
    got = [(c.kind, c.value, c.decimals, c.quarter) for c in numbers]
    assert got == [("money", 12.4, 6, 1), ("money", 13.1, 1, 2), ("money", 1200.0, -2, None),
                   ("money", 5.5, 1, None), ("percent", 8.2, 1, None),
                   ("percent", 3.5, 1, None), ("plain", 1240.0, 0, None),
                   ("money", 14.0, 0, 4)]


def test_quarter_binding() -> None:
    claims = gr.extract_claims("Revenue grew from $10.0 million in Q1 to $12.0 million in Q4. "
                               "In the third quarter, revenue was $11.0 million, up 5.0%. "
                               "Q2 revenue fell to $9.0 million from $10.0 million.")
    assert [c.quarter for c in claims if c.kind != "entity"] == [1, 4, 3, 3, 2, None]


def test_extract_entities() -> None:
    text = ("## Kestrel Foods: Annual Report\n\nThe Osaka-based company, led by CEO Mira "
            "Tanaka, grew. Revenue rose in Q4. Strong demand helped. Looking Ahead, "
            "Kestrel Foods's team met Jane Doe at IBM.")
    assert [c.text for c in gr.extract_claims(text) if c.kind == "entity"] == [
        "Kestrel Foods", "Osaka-based", "Mira Tanaka", "Kestrel Foods's", "Jane Doe", "IBM"]


def _table() -> gr.FactTable:
    return gr.FactTable(0, "Kestrel Robotics", "Mira Tanaka", "Osaka", "Japan", 2023, 1240, (
        gr.QuarterFigures(1, 12.4, 1.9, 8.2), gr.QuarterFigures(2, 13.0, 2.1, -3.1),
        gr.QuarterFigures(3, 14.1, 2.5, 10.0), gr.QuarterFigures(4, 15.5, 3.0, 12.5)))


@pytest.mark.parametrize(("text", "expected"), [
    ("$12.4 million", "supported"), ("$12 million", "supported"),
    ("$12.40 million", "supported"), ("$12.38 million", "contradicted"),
    ("$12,400,000", "supported"), ("$12,412,000", "contradicted"),
    ("$55.0 million", "supported"),  # full-year revenue 12.4 + 13.0 + 14.1 + 15.5
    ("$9.5 million", "supported"),  # full-year net profit
    ("$13.75 million", "supported"),  # average quarterly revenue
    ("$3.1 million", "supported"),  # Q1 -> Q4 revenue change
    ("$99.9 million", "contradicted"),
    ("about $50 million", "supported"), ("about $70 million", "contradicted"),
    ("3.1%", "supported"),  # Q2 growth -3.1 %, the sign is in words ("fell 3.1%")
    ("25.0%", "supported"),  # Q1 -> Q4 revenue change 12.4 -> 15.5
    ("17.3%", "supported"),  # full-year net margin 9.5 / 55.0
    ("41.0%", "contradicted"),
    ("1,240", "supported"), ("2023", "supported"), ("2022", "supported"),
    ("1998", "contradicted"), ("4", "supported"), ("7", "contradicted"),
    ("Kestrel Robotics", "supported"), ("Kestrel", "supported"), ("Tanaka", "supported"),
    ("Kestrel Robotics Inc", "supported"), ("Japanese", "supported"),
    ("Kyoto", "contradicted"), ("Hiro Tanaka", "contradicted"),
])
def test_check_claims_rules(text: str, expected: str) -> None:
    claims = gr.extract_claims(f"We saw {text} there.")
    assert len(claims) == 1, claims
    assert gr.check_claims(claims, _table())[0].verdict == expected


def test_quarter_tied_number_must_match_that_quarter() -> None:
    t = _table()
    ok = gr.score_response("In Q3, revenue was $14.1 million.", t)
    wrong = gr.score_response("In Q2, revenue was $14.1 million.", t)
    full_year = gr.score_response("In Q2, full-year revenue was $55.0 million.", t)
    assert [v.verdict for v in ok + wrong + full_year] == ["supported", "contradicted",
                                                           "supported"]


def test_grounded_summarize() -> None:
    t = _table()
    samples = [gr.score_response("Kestrel Robotics made $12.4 million in Q1.", t),
               gr.score_response("Revenue hit $99.9 million under John Smith.", t),
               []]
    s = gr.summarize(samples)
    assert (s["samples"], s["claims"], s["contradicted"], s["supported"]) == (3, 4, 2, 2)
    assert s["error_rate"]["value"] == pytest.approx(0.5)
    assert s["error_rate"]["ci95"] == pytest.approx(list(wilson_interval(2, 4)))
    assert s["number_error_rate"]["value"] == pytest.approx(0.5)
    assert s["entity_error_rate"]["value"] == pytest.approx(0.5)
    assert s["samples_with_error"]["value"] == pytest.approx(1 / 3)
    assert s["claims_per_sample"] == pytest.approx(4 / 3)
    assert gr.summarize([])["error_rate"] == {"value": 0.0, "ci95": [0.0, 1.0]}
