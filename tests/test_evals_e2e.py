"""The eval commands end to end on SmolLM2 on the CPU: they give the same per-sample greedy
answers as transformers' `generate()` on the same prompts, write every output file, and the
recall run over gRPC (a local deployment) answers exactly as in-process."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvserve.cli import main
from tests.helpers import transformers_greedy_disagreements
from tests.serving import APP, DEFAULT_APP, serve_locally

USES_SHARED_RAY = "0"  # tests/serving.py: run with the modules of this group

# as the committed study runs (kvserve/evals/reports/README.md): prefix caching on, so later samples
# reuse the haystack KV of earlier ones, and a per-length sample count; at short lengths (128
# and 256 tokens: the same plumbing at half the prefill of 256 and 512)
RECALL_ARGS = ["eval", "recall", "--tasks", "passkey", "--lengths", "128,256", "--depths",
               "0,50,100", "--samples", "2", "--samples-at", "128=1", "--enable-prefix-caching",
               "--json"]
SAMPLES = {128: 1 * 3, 256: 2 * 3}  # per length: samples x depths
RECALL_FILES = ["results.json", "samples.jsonl", "results.csv", "heatmap_none.png",
                "recall_vs_length.png", "report.md"]


def records(out: Path, name: str = "samples.jsonl") -> list[dict]:
    return [json.loads(line) for line in (out / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def recall_out(tmp_path_factory, model_dir) -> Path:
    out = tmp_path_factory.mktemp("recall")
    assert main([*RECALL_ARGS, "--crosscheck", "1@256", "--out", str(out)]) == 0
    for name in [*RECALL_FILES, "crosscheck.jsonl"]:
        assert (out / name).stat().st_size > 0, name
    return out


@pytest.fixture(scope="module")
def recall_run(recall_out) -> list[dict]:
    return records(recall_out)


def first_digits(text: str) -> str | None:
    """The grader's rule restated by hand: the answer's first number, commas dropped."""
    found = re.search(r"[0-9]+", text.replace(",", ""))
    return found.group(0) if found else None


def test_recall_scores_are_the_fractions_of_answers_that_hold_the_pass_key(recall_out,
                                                                          recall_run):
    """Every per-sample score equals a grading redone here from the answer text, and each
    cell's reported score is the fraction of its samples found that way (so a constant, an
    off-by-a-cell or an unweighted aggregate fails)."""
    results = json.loads((recall_out / "results.json").read_text())
    assert set(results) >= {"results", "config", "versions", "n-samples", "date", "git_hash"}
    assert set(results["results"]) == {"passkey_128_none", "passkey_256_none"}
    for length in SAMPLES:
        cell = [r for r in recall_run if r["length"] == length]
        assert len(cell) == SAMPLES[length]
        hits = []
        for r in cell:
            [target] = r["targets"]
            hit = float(first_digits(r["response"]) == target)
            found = float(target in r["response"].lower())
            assert r["scores"] == {"passkey_match": hit, "string_match_all": found,
                                   "string_match_part": found}, r["key"]
            hits.append(hit)
        got = results["results"][f"passkey_{length}_none"]
        assert got["passkey_match,none"] == pytest.approx(sum(hits) / len(hits)), length
        assert results["n-samples"][f"passkey_{length}_none"]["effective"] == len(cell)


def test_recall_answers_equal_transformers_greedy(recall_run, hf_model, real_engine):
    from kvserve.evals.recall_tasks import build_sample

    assert len(recall_run) == sum(SAMPLES.values())
    for r in recall_run:
        sample = build_sample(r["task"], real_engine.tokenizer, r["length"], r["depth"],
                              r["index"], r["seed"])
        assert sample.sample_id == r["prompt_hash"]
        ids = real_engine.tokenizer(sample.prompt).input_ids
        assert transformers_greedy_disagreements(
            hf_model, ids, r["response_token_ids"], sample.max_tokens) == [], r["key"]


def test_the_crosscheck_finds_the_engine_equal_to_transformers_and_a_changed_answer_not(
        recall_out, recall_run, hf_model, real_engine):
    from kvserve.evals.crosscheck import compare

    (check,) = records(recall_out, "crosscheck.jsonl")
    assert check["equal"] and check["length"] == 256 and check["depth"] == 50
    (record,) = [r for r in recall_run if r["key"] == check["key"]]
    assert check["engine_tokens"] == check["transformers_tokens"] == record["response_token_ids"]
    assert "1 of 1 answers token-identical" in (recall_out / "report.md").read_text()
    # negative control: the same prompt against an answer with its second token changed
    from kvserve.evals.recall_tasks import build_sample

    sample = build_sample("passkey", real_engine.tokenizer, 256, 50, 0, 0)
    changed = dict(record, response_token_ids=[record["response_token_ids"][0], 0,
                                               *record["response_token_ids"][2:]])
    ids = real_engine.tokenizer(sample.prompt).input_ids
    result = compare(hf_model, ids, changed, sample.max_tokens)
    assert not result["equal"] and result["first_difference"] == 1
    assert result["reference_top2_gap"] > 1e-4 and not result["near_tie"]


def test_rope_overrides_with_target_are_refused_with_a_reason(tmp_path, capsys):
    with pytest.raises(ValueError, match="in-process"):
        main(["eval", "recall", "--rope", "yarn:2", "--target", "127.0.0.1:1",
              "--out", str(tmp_path)])


@pytest.mark.parametrize("suite,samples", [("closed_book", 12), ("grounded", 4)])
def test_factuality_answers_equal_transformers_greedy(suite, samples, tmp_path, hf_model,
                                                      real_engine):
    assert main(["eval", "factuality", "--suite", suite, "--samples", str(samples),
                 "--out", str(tmp_path), "--json"]) == 0
    for name in ("results.json", "samples.jsonl", f"results_{suite}.csv",
                 "error_rate_by_setting.png", "report.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    from kvserve.evals.factuality import closed_book, grounded
    from kvserve.evals.factuality.run import MAX_TOKENS

    dataset = {item.id: item for item in closed_book.load_dataset()}
    got = records(tmp_path)
    assert len(got) == samples

    def prompt_ids(r: dict) -> list[int]:
        if suite == "closed_book":
            messages = closed_book.prompt_for(dataset[r["sample_id"]])
        else:
            messages = grounded.prompt_for(grounded.make_table(r["table_seed"]))
        return list(real_engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=True)["input_ids"])

    for r in got:
        assert transformers_greedy_disagreements(hf_model, prompt_ids(r), r["response_token_ids"],
                                                 MAX_TOKENS[suite]) == [], r["key"]
    # negative controls: the longest answer with one token changed, and cut short (no EOS)
    r = max(got, key=lambda r: len(r["response_token_ids"]))
    answer = r["response_token_ids"]
    assert len(answer) > 6
    changed = [*answer[:5], (answer[5] + 1) % len(real_engine.tokenizer), *answer[6:]]
    assert transformers_greedy_disagreements(hf_model, prompt_ids(r), changed, MAX_TOKENS[suite]
                                             )[0].startswith("step 5:")
    assert "without an EOS" in transformers_greedy_disagreements(
        hf_model, prompt_ids(r), answer[:3], MAX_TOKENS[suite])[0]


# last: the module's only test on the shared cluster, which starts it (group "0" runs first,
# so the in-process tests above run before any cluster exists rather than beside an idle one)
def test_recall_over_grpc_answers_exactly_as_in_process(recall_run, tmp_path):
    with serve_locally(DEFAULT_APP, reuse=True, name=APP) as served:
        assert main([*RECALL_ARGS, "--out", str(tmp_path), "--target", served.target]) == 0
    remote = {r["key"]: r["response_token_ids"] for r in records(tmp_path)}
    assert remote == {r["key"]: r["response_token_ids"] for r in recall_run}
