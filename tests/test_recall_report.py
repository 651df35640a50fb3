"""The recall study's plan (samples per length, variants at some lengths) and its report's
statistics: intervals per cell, and only separated intervals stated as differences."""

from __future__ import annotations

import pytest

from kvserve.cli import build_parser
from kvserve.cli.eval import recall_config
from kvserve.evals.recall import (
    MAIN_METRIC,
    build_all,
    format_cells,
    format_separations,
    format_timing,
    separations,
)
from kvserve.workers.model_executor.loader import load_tokenizer


def _config(*argv: str):
    return recall_config(build_parser().parse_args(["eval", "recall", *argv]))


def test_samples_per_length_and_variants_at_some_lengths_parse_into_the_plan(tmp_path):
    cfg = _config("--lengths", "1k,2k", "--depths", "0,100", "--samples", "3",
                  "--samples-at", "1k=1", "--rope", "none,yarn:4@2k", "--out", str(tmp_path),
                  "--enable-prefix-caching", "--max-num-seqs", "1")
    assert [cfg.samples_for(n) for n in (1024, 2048)] == [1, 3]
    none, yarn = cfg.variants
    assert (none.name, yarn.name) == ("none", "yarn:4")
    assert cfg.lengths_for(none) == [1024, 2048] and cfg.lengths_for(yarn) == [2048]
    assert cfg.engine["enable_prefix_caching"] is True and cfg.engine["max_num_seqs"] == 1
    samples = build_all(cfg, load_tokenizer(None))
    # two tasks x (1 sample x 2 depths at 1k + 3 samples x 2 depths at 2k)
    assert len(samples) == 2 * (1 * 2 + 3 * 2)


@pytest.mark.parametrize("argv,match", [
    (["--samples-at", "1k"], "LENGTH=COUNT"),
    (["--samples-at", "1k=0"], "LENGTH=COUNT"),
    (["--crosscheck", "3"], "COUNT@LENGTH"),
    (["--crosscheck", "0@12k"], "COUNT@LENGTH"),
])
def test_bad_per_length_counts_are_refused_naming_the_flag(argv, match, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["eval", "recall", *argv])
    err = capsys.readouterr().err
    assert argv[0] in err and match in err


def test_a_crosscheck_at_a_length_not_run_is_refused(tmp_path):
    assert _config("--lengths", "1k", "--crosscheck", "3@1k", "--out",
                   str(tmp_path)).crosscheck == (3, 1024)
    with pytest.raises(ValueError, match="--crosscheck"):
        _config("--lengths", "1k", "--crosscheck", "3@2k", "--out", str(tmp_path))


def test_a_variant_at_a_length_not_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="yarn:4@"):
        _config("--lengths", "1k", "--rope", "yarn:4@2k", "--out", str(tmp_path))


def _cells(scores: dict[tuple[str, str, int], list[float]]) -> dict:
    """Synthetic logged records, one depth per cell: (variant, task, length) -> depth -> records."""
    return {key: {50.0: [{"scores": {MAIN_METRIC: s}, "seconds": 2.0, "machine": "cpu X"}
                         for s in values]} for key, values in scores.items()}


def test_only_non_overlapping_wilson_intervals_are_separations():
    cells = _cells({
        ("none", "passkey", 12288): [0.0] * 20,
        ("yarn:2", "passkey", 12288): [1.0] * 18 + [0.0] * 2,
        ("dynamic:2", "passkey", 12288): [1.0] * 12 + [0.0] * 8,  # 60 %: [39, 78]
        ("linear:2", "passkey", 12288): [1.0] * 9 + [0.0] * 11,  # 45 %: [26, 66]
    })
    found = separations(cells)
    assert ("passkey", 12288, "yarn:2", "none") in found
    assert ("passkey", 12288, "dynamic:2", "none") in found
    assert ("passkey", 12288, "yarn:2", "linear:2") in found  # 90 [70, 97] vs [26, 66]
    # 60 % and 45 % of 20 overlap, as do 90 % and 60 %: neither may be stated
    assert not {("passkey", 12288, "dynamic:2", "linear:2"),
                ("passkey", 12288, "yarn:2", "dynamic:2")} & set(found)
    # the pooled "both" row exists for each length, and only pairs in one (task, length)
    assert all(f[0] in ("passkey", "both") for f in found)
    text = format_separations(cells)
    assert "- passkey, 12288: yarn:2 > none" in text


def test_the_cell_table_shows_counts_and_intervals_and_the_time_table_sums():
    cells = _cells({("none", "passkey", 4096): [1.0] * 5, ("none", "niah_single", 4096):
                    [1.0] * 4 + [0.0]})
    table = format_cells(cells)
    assert "| none | 100 [57, 100] (5/5) |" in table  # Wilson 5/5: [0.566, 1]
    assert "| none | 90 [60, 98] (9/10) |" in table  # both tasks pooled
    timing = format_timing(cells)
    assert "| 4096 | 10 | 10 | 2.0 | 2.0 | 20 |" in timing and "cpu X" in timing


def test_report_only_reports_the_logged_samples_and_answers_nothing(tmp_path, monkeypatch):
    import json

    import kvserve.evals.recall
    from kvserve.evals.recall import run_recall, sample_key

    def no_engine(*args, **kwargs):
        raise AssertionError("report-only must not load a model")

    monkeypatch.setattr(kvserve.evals.recall, "make_generator", no_engine)
    argv = ("--tasks", "passkey", "--lengths", "1k", "--depths", "0,50", "--samples", "1",
            "--out", str(tmp_path))
    cfg = _config(*argv, "--report-only")
    logged = build_all(cfg, load_tokenizer(None))[1]  # depth 50 answered, depth 0 not yet
    (variant,) = cfg.variants
    record = {"key": sample_key(variant, logged), "variant": "none", "task": "passkey",
              "length": 1024, "depth": 50.0, "index": 0, "response": " 1",
              "response_token_ids": [1], "scores": {MAIN_METRIC: 1.0, "string_match_part": 1.0,
                                                    "passkey_match": 1.0}}
    (tmp_path / "samples.jsonl").write_text(json.dumps(record) + "\n")
    result = run_recall(cfg, progress=False)
    assert "(1/1)" in (tmp_path / "report.md").read_text()
    entry = json.loads((tmp_path / "results.json").read_text())["n-samples"]
    assert entry["passkey_1024_none"] == {"original": 2, "effective": 1}
    assert result["results"]["passkey_1024_none"]
    with pytest.raises(AssertionError, match="report-only"):  # control: without the flag
        run_recall(_config(*argv), progress=False)
