"""Long-context recall samples (kvserve/evals/recall_tasks.py, kvserve/evals/haystack.py) and their
scoring
(kvserve/evals/scoring.py), with the real SmolLM2 tokenizer (local, never downloaded)."""

from __future__ import annotations

import hashlib
import math
import re
import statistics
import time
import uuid

import pytest

from kvserve.evals.haystack import NOISE, ends_sentence, haystack_sentences, split_sentences
from kvserve.evals.recall_tasks import TASKS, RecallSample, build_sample
from kvserve.evals.scoring import (
    TASK_METRICS,
    first_number,
    passkey_match,
    score_sample,
    string_match_all,
    string_match_part,
    summarize_cell,
)
from kvserve.evals.stats import Z_95, wilson_interval
from kvserve.workers.core.inputs import to_token_ids
from kvserve.workers.model_executor.loader import load_tokenizer

NEEDLE = re.compile(
    r"The pass key is (?P<pk>\d+)\. Remember it\. (?P=pk) is the pass key\."
    r"|One of the special magic \w+ for (?P<key>[\w-]+) is: (?P<value>[\w-]+)\."
)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def _context(sample: RecallSample) -> tuple[int, str]:
    """(offset in the prompt, text) of the haystack line between the intro and the question."""
    intro, context, _question = sample.prompt.split("\n")
    return len(intro) + 1, context


def _needles(sample: RecallSample) -> list[re.Match]:
    return list(NEEDLE.finditer(_context(sample)[1]))


def _value(m: re.Match) -> str:
    return m.group("pk") or m.group("value")


def _depth_fraction(tok, sample: RecallSample) -> float:
    """Token fraction of the haystack (needles removed) before the first asked-for needle."""
    context = _context(sample)[1]
    first = next(m for m in _needles(sample) if _value(m) in sample.targets)
    before = NEEDLE.sub("", context[: first.start()])
    whole = NEEDLE.sub("", context)
    count = lambda s: len(tok(" ".join(s.split()), add_special_tokens=False)["input_ids"])  # noqa: E731
    return count(before) / count(whole)


# --- sample construction -----------------------------------------------------------------


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("length", [256, 1000, 4000])
@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_length_within_one_percent(tok, task, length, haystack):
    s = build_sample(task, tok, length, 50, 0, 7, haystack=haystack)
    assert abs(s.prompt_tokens - length) <= 0.01 * length
    # counted exactly as the engine counts a text prompt
    assert s.prompt_tokens == len(to_token_ids(tok, len(tok), prompt=s.prompt))


@pytest.mark.parametrize("task,haystack", [("passkey", "noise"), ("niah_single", "prose")])
def test_16k_tokens_fast_and_within_one_percent(tok, task, haystack):
    build_sample(task, tok, 1000, 50, 0, 0, haystack=haystack)  # warm the sentence cache
    t0 = time.perf_counter()
    s = build_sample(task, tok, 16000, 50, 0, 1, haystack=haystack)
    elapsed = time.perf_counter() - t0
    assert abs(s.prompt_tokens - 16000) <= 160
    assert s.prompt_tokens == len(tok(s.prompt)["input_ids"])
    assert elapsed < 2.0, f"building a 16k-token sample took {elapsed:.2f}s"


@pytest.mark.parametrize("value_kind", ["numbers", "words", "uuids"])
def test_length_within_one_percent_for_every_value_kind(tok, value_kind):
    for task in TASKS[1:]:
        s = build_sample(task, tok, 2000, 30, 3, 5, haystack="prose", value_kind=value_kind)
        assert abs(s.prompt_tokens - 2000) <= 20


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("haystack", ["noise", "prose"])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_needle_at_depth(tok, task, haystack, depth):
    s = build_sample(task, tok, 4000, depth, 0, 11, haystack=haystack)
    assert s.depth == depth
    assert _depth_fraction(tok, s) == pytest.approx(depth / 100, abs=0.02)


def test_depth_extremes_are_the_ends_of_the_haystack(tok):
    first = build_sample("niah_single", tok, 1000, 0, 0, 1)
    assert _context(first)[1].startswith("One of the special magic numbers for ")
    last = build_sample("passkey", tok, 1000, 100, 0, 1, haystack="prose")
    assert re.search(r"\d+ is the pass key\.$", _context(last)[1])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("haystack", ["noise", "prose"])
def test_needles_on_sentence_boundaries(tok, task, haystack):
    for depth in (0, 10, 33.3, 50, 90, 100):
        s = build_sample(task, tok, 1500, depth, 2, 3, haystack=haystack)
        offset, _ = _context(s)
        needles = _needles(s)
        assert needles
        for m in needles:
            before = s.prompt[: offset + m.start()]
            after = s.prompt[offset + m.end():]
            assert ends_sentence(before), before[-60:]
            assert before.endswith((" ", "\n"))
            assert re.match(r"( [A-Z\"'(\[0-9]|\n)", after), after[:60]


@pytest.mark.parametrize("task", TASKS)
def test_deterministic_from_the_seed(tok, task):
    a = build_sample(task, tok, 1200, 40, 5, 123, haystack="prose")
    b = build_sample(task, tok, 1200, 40, 5, 123, haystack="prose")
    assert a == b and a.sample_id == b.sample_id
    other_index = build_sample(task, tok, 1200, 40, 6, 123, haystack="prose")
    other_seed = build_sample(task, tok, 1200, 40, 5, 124, haystack="prose")
    assert other_index.targets != a.targets and other_index.prompt != a.prompt
    assert other_seed.targets != a.targets
    # the haystack is not in the seed: the same needles over noise and prose
    assert build_sample(task, tok, 1200, 40, 5, 123, haystack="noise").targets == a.targets
    # depth given as int or float names the same sample
    assert build_sample(task, tok, 1200, 40.0, 5, 123, haystack="prose") == a


def test_sample_fields(tok):
    s = build_sample("niah_single", tok, 1000, 50, 4, 9)
    assert (s.task, s.length, s.depth, s.index, s.seed) == ("niah_single", 1000, 50.0, 4, 9)
    assert s.sample_id == hashlib.sha256(s.prompt.encode()).hexdigest()[:16]
    assert re.fullmatch(r"[0-9a-f]{16}", s.sample_id)
    assert s.prompt.endswith("mentioned in the provided text is")
    answer = len(tok(" " + s.targets[0] + ".", add_special_tokens=False)["input_ids"])
    assert s.max_tokens >= answer + 8


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("value_kind", ["numbers", "words", "uuids"])
def test_targets_are_in_the_prompt(tok, task, value_kind):
    s = build_sample(task, tok, 800, 50, 0, 2, value_kind=value_kind)
    assert s.targets and len(set(s.targets)) == len(s.targets)
    for t in s.targets:
        assert t in s.prompt
    asked = [m for m in _needles(s) if _value(m) in s.targets]
    assert sorted(_value(m) for m in asked) == sorted(s.targets)
    # answers fit the generation budget
    needed = len(tok(" " + ", ".join(s.targets), add_special_tokens=False)["input_ids"])
    assert s.max_tokens > needed


def test_passkey_prompt(tok):
    s = build_sample("passkey", tok, 1000, 50, 0, 1)
    (key,) = s.targets
    assert re.fullmatch(r"\d{5}", key)
    assert s.prompt.startswith("There is an important info hidden inside a lot of irrelevant text.")
    assert s.prompt.endswith("\nWhat is the pass key? The pass key is")
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in s.prompt
    assert NOISE in s.prompt
    # passkey is always a number, whatever value_kind says
    assert re.fullmatch(r"\d{5}", build_sample("passkey", tok, 500, 50, 0, 1, "noise",
                                                "uuids").targets[0])


def test_value_kinds(tok):
    words = build_sample("niah_single", tok, 600, 50, 0, 1, value_kind="words")
    assert re.fullmatch(r"[a-z]+-[a-z]+", words.targets[0])
    assert "A special magic word is hidden" in words.prompt
    uuids = build_sample("niah_multivalue", tok, 1000, 50, 0, 1, value_kind="uuids")
    assert all(uuid.UUID(t).version == 4 for t in uuids.targets)
    assert "Some special magic uuids are hidden" in uuids.prompt
    numbers = build_sample("niah_single", tok, 600, 50, 0, 1)
    assert re.fullmatch(r"\d{7}", numbers.targets[0])


def test_multikey_has_distinct_distractors(tok):
    spread: set[float] = set()
    for index in range(5):
        s = build_sample("niah_multikey", tok, 2000, 50, index, 1, haystack="prose")
        needles = _needles(s)
        keys = [m.group("key") for m in needles]
        assert len(needles) == 4 and len(set(keys)) == 4
        assert len({m.group("value") for m in needles}) == 4
        (target,) = s.targets
        asked = [m.group("key") for m in needles if m.group("value") == target]
        assert len(asked) == 1
        question = s.prompt.rsplit("\n", 1)[1]
        assert f"for {asked[0]} mentioned" in question
        assert all(k not in question for k in keys if k != asked[0])  # distractors not asked
        spread.update(round(m.start() / len(_context(s)[1]), 1) for m in needles
                      if m.group("value") != target)
    assert len(spread) >= 4  # distractors are scattered, not piled next to the needle


def test_multivalue_one_key_all_values(tok):
    s = build_sample("niah_multivalue", tok, 1500, 60, 0, 1)
    needles = _needles(s)
    assert len(s.targets) == 4 and len(needles) == 4
    assert {m.group("key") for m in needles} == {needles[0].group("key")}
    assert sorted(_value(m) for m in needles) == sorted(s.targets)
    assert s.prompt.endswith("mentioned in the provided text are")
    assert "What are all the special magic numbers for " + needles[0].group("key") in s.prompt


def test_multiquery_asks_every_key(tok):
    s = build_sample("niah_multiquery", tok, 1500, 60, 0, 1)
    needles = _needles(s)
    assert len(s.targets) == 4 and len(needles) == 4
    question = s.prompt.rsplit("\n", 1)[1]
    for m in needles:
        assert m.group("key") in question and m.group("value") in s.targets
    assert ", and " in question


def test_prose_haystack(tok):
    s = build_sample("niah_single", tok, 3000, 50, 0, 1, haystack="prose")
    sentences, starts = haystack_sentences("prose")
    assert len(sentences) > 1000 and len(starts) > 400
    context = NEEDLE.sub("", _context(s)[1])
    assert "The grass is green." not in context
    assert sum(sent in context for sent in sentences[:: 25]) >= 1
    assert all(ends_sentence(sent) for sent in sentences)


def test_user_text_haystack(tok):
    text = ("Alice walked to the market. She bought three apples! Did she pay? Yes, she did.\n\n"
            "Bob stayed at home. He read e.g. a novel about ships.")
    s = build_sample("niah_single", tok, 600, 50, 0, 1, haystack=text)
    assert abs(s.prompt_tokens - 600) <= 6
    assert "He read e.g. a novel about ships." in s.prompt


def test_bad_arguments(tok):
    with pytest.raises(ValueError, match="unknown task"):
        build_sample("vt", tok, 1000, 50, 0, 0)
    with pytest.raises(ValueError, match="depth"):
        build_sample("passkey", tok, 1000, 101, 0, 0)
    with pytest.raises(ValueError, match="value_kind"):
        build_sample("niah_single", tok, 1000, 50, 0, 0, value_kind="emoji")
    with pytest.raises(ValueError, match="within 1%"):
        build_sample("niah_multiquery", tok, 60, 50, 0, 0)  # smaller than the template


def test_split_sentences():
    text = 'See e.g. the docs. It works, i.e. fine! Really? "Yes." Mr. X met A. B. Smith. 3 is ok.'
    assert split_sentences(text) == [
        "See e.g. the docs.", "It works, i.e. fine!", "Really?", '"Yes."',
        "Mr. X met A. B. Smith.", "3 is ok.",
    ]
    assert split_sentences(NOISE) == [
        "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
        "There and back again.",
    ]
    assert ends_sentence('He said "stop."') and ends_sentence("(Done.)\n")
    assert not ends_sentence("the value is: ") and not ends_sentence("")


# --- scoring -------------------------------------------------------------------------------


def test_string_match_all():
    assert string_match_all("1234567", ["1234567"]) == 1.0
    assert string_match_all("The special magic number is 1234567.", ["1234567"]) == 1.0
    assert string_match_all("1234567, 7654321 and 1111111", ["1234567", "7654321",
                                                              "2222222", "1111111"]) == 0.75
    assert string_match_all("QUIET-HARBOR", ["quiet-harbor"]) == 1.0  # case-insensitive
    assert string_match_all("none of them", ["1234567", "7654321"]) == 0.0
    assert string_match_all("  \x00 1234567\n", ["1234567"]) == 1.0
    assert string_match_all("12345678", ["1234567"]) == 1.0  # RULER: substring, lenient
    assert string_match_all("123 4567", ["1234567"]) == 0.0  # split digits do not count
    assert string_match_all("", ["1234567"]) == 0.0


def test_string_match_part():
    targets = ["1234567", "7654321"]
    assert string_match_part("it is 7654321", targets) == 1.0
    assert string_match_part("1234567 and 7654321", targets) == 1.0
    assert string_match_part("neither", targets) == 0.0
    assert string_match_part("A3F0-UUID", ["a3f0-uuid"]) == 1.0
    with pytest.raises(ValueError):
        string_match_part("x", [])


@pytest.mark.parametrize(
    "answer,score",
    [
        (" 12345.", 1.0),
        ("The pass key is 12345. Remember it.", 1.0),
        ("12345 is the pass key. 12345 is the pass key.", 1.0),
        ("12,345", 1.0),  # thousands separators are formatting
        ("\n\n12345\n", 1.0),
        ("key12345", 1.0),  # digits glued to a word still form the first number
        ("-12345", 1.0),  # the sign is ignored
        ("123456", 0.0),  # a longer number is a different number
        ("1234", 0.0),
        ("12345.6", 0.0),  # a decimal is a different number
        ("012345", 0.0),  # digits are compared as written
        ("It is 5 digits long: 12345", 0.0),  # only the first number counts
        ("1,2345", 0.0),  # not a thousands grouping: the first number is 1
        ("12 345", 0.0),
        ("I do not know.", 0.0),
        ("", 0.0),
    ],
)
def test_passkey_match(answer, score):
    assert passkey_match(answer, "12345") == score


def test_first_number():
    assert first_number("about 1,234,567.5 things") == "1234567.5"
    assert first_number("12345,678") == "12345"
    assert first_number("no digits") is None


def test_score_sample_metrics_per_task():
    for task in TASKS:
        scores = score_sample(task, "The answer is 12345.", ["12345"])
        assert tuple(scores) == TASK_METRICS[task]
        assert all(v == 1.0 for v in scores.values())
    # a number inside a longer one: substring metrics pass, the passkey check does not
    assert score_sample("passkey", "123456", ["12345"]) == {
        "passkey_match": 0.0, "string_match_all": 1.0, "string_match_part": 1.0}
    assert score_sample("niah_multivalue", "1111111 and 2222222", ["1111111", "2222222",
                                                                   "3333333", "4444444"]) == {
        "string_match_all": 0.5, "string_match_part": 1.0}
    with pytest.raises(ValueError):
        score_sample("nope", "1", ["1"])


def test_summarize_cell():
    cell = summarize_cell([1.0, 1.0, 0.0, 0.0])
    assert cell["mean"] == 0.5 and cell["n"] == 4
    assert (cell["ci_low"], cell["ci_high"]) == wilson_interval(2, 4)
    assert cell["stderr"] == pytest.approx(math.sqrt((4 * 0.25) / 3 / 4))
    fractional = summarize_cell([0.75, 0.25, 0.5])
    assert fractional["mean"] == pytest.approx(0.5)
    assert (fractional["ci_low"], fractional["ci_high"]) == pytest.approx(wilson_interval(1.5, 3))
    perfect = summarize_cell([1.0] * 20)
    assert perfect["mean"] == 1.0 and perfect["ci_high"] == 1.0 and perfect["ci_low"] < 1.0
    empty = summarize_cell([])
    assert empty["n"] == 0 and math.isnan(empty["mean"])
    assert (empty["ci_low"], empty["ci_high"]) == (0.0, 1.0)


def _wilson_roots(k: float, n: int, z: float) -> tuple[float, float]:
    """The Wilson interval written independently of `kvserve.evals.stats`: the two roots in pi of
    (k/n - pi)^2 = z^2 pi (1 - pi) / n, a quadratic a pi^2 + b pi + c = 0."""
    p, zz = k / n, z * z / n
    a, b, c = 1 + zz, -(2 * p + zz), p * p
    root = math.sqrt(b * b - 4 * a * c)
    return (-b - root) / (2 * a), (-b + root) / (2 * a)


def test_wilson_interval_known_values():
    """Against published values, not against itself: Newcombe (1998), "Two-sided confidence
    intervals for the single proportion", Statistics in Medicine 17:857-872, Table I (the
    score method), to the 4 decimals printed there; and the textbook 2 of 4 case."""
    assert math.isclose(Z_95, statistics.NormalDist().inv_cdf(0.975), abs_tol=1e-12)
    published = {(81, 263): (0.2553, 0.3662), (15, 148): (0.0624, 0.1605),
                 (0, 20): (0.0, 0.1611), (1, 29): (0.0061, 0.1718), (2, 4): (0.1500, 0.8500)}
    for (k, n), (low, high) in published.items():
        assert wilson_interval(k, n) == pytest.approx((low, high), abs=5e-5), (k, n)
    # the edges: 0 of 10 and 10 of 10 mirror each other, and touch 0 and 1 exactly
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=5e-5)
    assert wilson_interval(10, 10) == pytest.approx((0.7225, 1.0), abs=5e-5)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == pytest.approx(1.0)
    # any n, k and z against the closed form solved another way (large n: close to normal)
    for k, n, z in ((4500, 10000, Z_95), (3, 7, Z_95), (1.5, 3, Z_95), (40, 50, 2.5758)):
        assert wilson_interval(k, n, z) == pytest.approx(_wilson_roots(k, n, z), abs=1e-12)
    low, high = wilson_interval(4500, 10000)
    assert high - low == pytest.approx(2 * Z_95 * math.sqrt(0.45 * 0.55 / 10000), rel=1e-3)
