"""The lm-evaluation-harness task's scoring and the comparison with the in-process engine
(kvserve/evals/harness), on logged samples shaped as lm-eval 0.4 writes them."""

from __future__ import annotations

import json

from kvserve.evals.harness.compare import compare, read_samples
from kvserve.evals.harness.utils import contains_answer, process_results


def test_an_answer_counts_when_it_appears_as_whole_words():
    assert contains_answer("The capital of France is Paris.", ["Paris"])
    assert contains_answer("ROMA!", ["Rome", "Roma"])
    assert contains_answer("It is New  Delhi.", ["New Delhi"])
    assert not contains_answer("Parisian cafes.", ["Paris"])
    assert not contains_answer("", ["Paris"])
    assert process_results({"answers": ["Berlin"]}, ["Berlin, of course"]) == {
        "contains_answer": 1.0}


def _sample(doc_id: int, reply: str, answers: list[str]) -> dict:
    messages = json.dumps([{"role": "user", "content": f"Question {doc_id}?\nAnswer:"}])
    return {"doc_id": doc_id, "doc": {"answers": answers},
            "arguments": {"gen_args_0": {"arg_0": [messages],
                                         "arg_1": {"until": ["\n"], "max_gen_toks": 16}}},
            "resps": [[reply]], "contains_answer": float(contains_answer(reply, answers))}


def test_compare_names_every_answer_the_engine_gave_differently(tmp_path):
    samples = [_sample(0, "It is Paris.", ["Paris"]), _sample(1, "Bonn.", ["Berlin"])]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "samples_kvserve_closed_book_2026.jsonl").write_text(
        "\n".join(json.dumps(s) for s in samples))
    assert read_samples(tmp_path) == samples
    same = compare(samples, ["It is Paris.", "Bonn."])
    assert same["identical"] == 2 and same["differ"] == []
    assert same["harness_score"] == same["engine_score"] == 0.5
    other = compare(samples, ["It is Paris.", "Berlin."])
    assert other["differ"] == [{"doc": 1, "harness": "Bonn.", "engine": "Berlin."}]
    assert other["engine_score"] == 1.0
