"""kvserve.bench.gpu_check, the one device check: its --dry-run (the same code on the CPU with tiny
shapes) runs here in CI, so the script cannot rot between the rare runs on a GPU machine."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kvserve.bench import gpu_check
from kvserve.bench.gpu_check import SECTIONS, Context, Report, Skip

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_check") / "results.json"
    proc = subprocess.run([sys.executable, "-m", "kvserve.bench.gpu_check", "--dry-run", "--out",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.exists(), proc.stderr[-3000:]
    return json.loads(out.read_text()), proc


def test_dry_run_reports_every_section_ok_or_skipped_with_a_reason(dry_run):
    report, proc = dry_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert report["dry_run"] is True and report["date"] and report["finished"]
    env = report["environment"]
    assert {"torch", "transformers", "cuda", "device", "python"} <= set(env)
    assert list(report["sections"]) == list(SECTIONS)
    for name, section in report["sections"].items():
        assert section["status"] in ("ok", "skipped"), (name, section)
        if section["status"] == "skipped":
            assert section["reason"], name
        assert section["seconds"] >= 0
    assert report["sections"]["flash_checks"] == {
        "status": "skipped", "reason": "no CUDA", "result": {},
        "seconds": report["sections"]["flash_checks"]["seconds"]}


def test_dry_run_numbers_are_sensible(dry_run):
    sections = dry_run[0]["sections"]
    tests = sections["gpu_tests"]["result"]
    assert "tests/test_flash_backend.py" in tests["files"] and tests["marker"] == "gpu"
    assert tests["counts"].get("skipped", 0) > 0 and not tests["counts"].get("failed")
    models = sections["exactness"]["result"]["models"]
    assert len(models) == 2
    for result in models.values():
        for key in ("control_hf_eager_vs_sdpa", "torch"):
            for summary in ([result[key]] if key.startswith("control") else
                            [result[key][m] for m in ("alone", "concurrent",
                                                      "concurrent_vs_alone")]):
                assert {"prompts", "identical", "close", "failed", "first_diffs"} <= set(summary)
                assert summary["prompts"] == 3
        assert result["flash_attn"] == {"skipped": "no CUDA"}
        assert result["all_close"] is True
    bench = sections["throughput"]["result"]["shapes"]["tiny"]
    engine = bench["engine"]
    assert engine["attention_backend"] == "cpu" and engine["cuda_graph_sizes"] == []
    for n in ("1", "4"):
        run = bench["runs"][n]
        assert run["kvserve"]["tok_s"] > 0 and not run["kvserve"]["truncated"]
        assert run["kvserve"]["tokens"] == run["kvserve"]["expected_tokens"]
        for baseline in ("hf_generate_batch", "hf_generate"):  # both transformers baselines ran
            assert run[baseline]["tokens"] == run["kvserve"]["tokens"], (n, baseline, run)
            assert run[f"kvserve_vs_{baseline}"] > 0
    batch1 = bench["batch1"]
    assert batch1["decode_ms_per_token"] > 0 and batch1["copy_bandwidth_bytes_per_s"] > 0
    assert batch1["decode_vs_spec_bound"] > 0
    anatomy = bench["step_breakdown"]
    assert anatomy["step_ms"] > 0 and anatomy["async_step_ms"] > 0
    assert anatomy["gpu_busy_ms"] is None  # no GPU to profile
    # the targets are listed, not measurable here (no 1B shape, no triton graphs)
    targets = dry_run[0]["targets"]
    assert {"batch1_decode_vs_measured_bound", "tok_s_at_256_requests", "tok_s_at_32_requests",
            "vs_generate_batch_at_256_requests"} <= set(targets)
    assert all(t["met"] is None for t in targets.values())


def _context(tmp_path: Path, caps: dict[str, float]) -> Context:
    plan = dataclasses.replace(gpu_check.dry_run_plan(), section_caps_s=caps)
    report = Report(tmp_path / "r.json", {"check": "test"})
    return Context(plan, report, time.monotonic() + 60)


def test_a_failing_section_is_recorded_and_the_rest_still_run(tmp_path):
    def fails(ctx, out):
        out["measured"] = 1  # what it measured before failing stays
        raise RuntimeError("boom")

    def skips(ctx, out):
        raise Skip("no CUDA")

    def hangs(ctx, out):
        time.sleep(30)

    def works(ctx, out):
        out["value"] = 2

    ctx = _context(tmp_path, {"hangs": 1})
    clean = gpu_check.run_sections(ctx, {"fails": fails, "skips": skips, "hangs": hangs,
                                         "works": works})
    assert not clean
    sections = json.loads((tmp_path / "r.json").read_text())["sections"]
    assert sections["fails"]["status"] == "error"
    assert "boom" in sections["fails"]["error"] and "RuntimeError" in sections["fails"]["traceback"]
    assert sections["fails"]["result"] == {"measured": 1}
    assert sections["skips"]["status"] == "skipped" and sections["skips"]["reason"] == "no CUDA"
    assert sections["hangs"]["status"] == "timeout" and sections["hangs"]["seconds"] < 5
    assert sections["works"] == {"status": "ok", "result": {"value": 2},
                                 "seconds": sections["works"]["seconds"]}


def test_pytest_counts_reads_the_summary_line():
    text = "....F\n=== short test summary ===\nFAILED x\n1 failed, 4 passed, 2 skipped in 3.1s\n"
    assert gpu_check.pytest_counts(text) == {"failed": 1, "passed": 4, "skipped": 2}
    assert gpu_check.pytest_counts("2 errors, 1 warning in 0.5s") == {"error": 2, "warning": 1}
    assert gpu_check.pytest_counts("no summary") == {}


def test_sections_option_validates_names():
    assert gpu_check.parse_args(["--sections", "throughput,exactness"]).sections == [
        "throughput", "exactness"]
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--sections", "nope"])


class EndlessEngine:
    """Pure-logic stand-in for LLMEngine: every step emits one token per live request and no
    request ever finishes, so only the time cap can end a run."""

    def __init__(self) -> None:
        self.live: list[str] = []
        self.params: list[dict] = []

    def add_request(self, prompt_token_ids, params) -> str:
        self.params.append(params)
        self.live.append(f"r{len(self.params)}")
        return self.live[-1]

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list:
        time.sleep(0.01)
        return [dataclasses.make_dataclass("Out", ["token_ids"])([7]) for _ in self.live]

    def abort(self, request_id: str) -> None:
        self.live.remove(request_id)


def test_capped_throughput_stops_at_the_cap_and_aborts_the_rest():
    engine = EndlessEngine()
    result = gpu_check.capped_kvserve_throughput(engine, [[101, 102], [103, 104]], 8, cap_s=0.05)
    assert result["truncated"] and not engine.live  # every request aborted at the cap
    assert result["tokens"] == 2 * result["steps"] and result["expected_tokens"] == 16
    assert 0.05 < result["seconds"] < 5 and result["tok_s"] == result["tokens"] / result["seconds"]
    assert engine.params == [{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True}] * 2


@pytest.mark.parametrize("make_plan", [gpu_check.gpu_plan, gpu_check.dry_run_plan],
                         ids=["gpu", "dry_run"])
def test_every_exactness_prompt_fits_each_models_context(make_plan):
    """Every exactness prompt plus its new tokens fits each model's positions, checked on the
    CPU for both plans. Negative control: with the tiny config's 512 positions, a 511-token
    prompt + 32 new tokens fails here (the engine refuses it; transformers only warns)."""
    from kvserve.workers.model_executor.tiny import tiny_config

    plan = make_plan()
    longest = max(plan.exact_prompt_lens) + plan.exact_new_tokens
    for name, overrides in plan.exact_models.items():
        context = tiny_config("llama", **overrides).max_position_embeddings
        assert longest <= context, (name, longest, context)


def test_the_generate_batch_config_takes_the_installed_transformers_names(monkeypatch):
    """transformers 5.17 names the page `block_size` and has no `auto_switch_to_flash`; 5.25
    says `page_size`. `cb_config_for` passes each version what its ContinuousBatchingConfig
    takes. Negative control: a `cb_config_for` that always passes `page_size` fails here with
    `Old`'s TypeError."""
    import types

    import transformers

    from kvserve.bench.baselines import CB_PAGE_SIZE, cb_config_for
    from kvserve.workers.model_executor.tiny import tiny_config

    class Old:  # 5.17's parameters, those this code sets
        def __init__(self, block_size=256, num_blocks=None, max_batch_tokens=None,
                     max_requests_per_batch=None):
            self.block_size, self.num_blocks = block_size, num_blocks

    config = tiny_config("llama")
    model = types.SimpleNamespace(config=types.SimpleNamespace(get_text_config=lambda: config),
                                  dtype=torch.float32)
    prompts = [[1] * 20, [2] * 30]
    monkeypatch.setattr(transformers, "ContinuousBatchingConfig", Old)
    old = cb_config_for(model, prompts, 8)
    assert old.block_size == CB_PAGE_SIZE and old.num_blocks >= 2
    monkeypatch.undo()
    assert cb_config_for(model, prompts, 8).page_size == CB_PAGE_SIZE  # the installed one


def test_the_gpu_plan_runs_the_triton_tests_and_every_backend_with_and_without_graphs():
    plan = gpu_check.gpu_plan()
    assert plan.gpu_test_marker == "gpu or triton"
    files, _ = gpu_check.gpu_test_files(markers=("gpu", "triton"))
    assert {"tests/test_triton_ops.py", "tests/test_triton_attention.py",
            "tests/test_cuda_graphs.py"} <= set(files)
    assert gpu_check.unavailable_on_the_device("kvserve.cluster.app")
    assert not gpu_check.unavailable_on_the_device("kvserve.workers.engine")
    assert plan.exact_backends == ("torch", "flash_attn", "triton", "triton_graphs")
    assert gpu_check.EXACT_BACKENDS["triton_graphs"] == ("triton", False)
    assert plan.bench_requests == (1, 32, 256)
    assert set(plan.bench_shapes) == {gpu_check.TARGET_SHAPE, "smollm2_shape"}


def test_a_triton_engine_with_graphs_on_a_cpu_runs_their_static_path():
    """The check's engine factory: on a CPU (the dry run) the graphs' static-buffer path is
    turned on eagerly, as on CUDA they are captured."""
    from kvserve.workers.model_executor.tiny import tiny_checkpoint

    ckpt = tiny_checkpoint("llama")
    engine = gpu_check.make_engine(ckpt, "cpu", "triton", False, kv_cache_memory=2**22,
                                   max_num_seqs=4)
    report = gpu_check.engine_report(engine)
    assert report["attention_backend"] == "triton" and report["cuda_graph_sizes"] == []
    assert report["graph_replays"] == {1: 0, 2: 0, 4: 0}
    eager = gpu_check.make_engine(ckpt, "cpu", "triton", True, kv_cache_memory=2**22)
    assert gpu_check.engine_report(eager)["graph_replays"] is None


def test_targets_read_the_report_and_say_which_are_met():
    shape = {"batch1": {"decode_vs_measured_bound": 2.5},
             "runs": {"256": {"kvserve": {"tok_s": 19_000.0}, "kvserve_vs_hf_generate_batch": 6},
                      "32": {"kvserve": {"tok_s": 5_000.0}}}}
    graphs = {"alone": {"prompts": 8, "failed": []}, "concurrent": {"prompts": 8, "failed": [{}]},
              "concurrent_vs_alone": {"identical": 8}}
    sections = {"throughput": {"result": {"shapes": {gpu_check.TARGET_SHAPE: shape}}},
                "exactness": {"result": {"models": {"m": {"triton_graphs": graphs},
                                                    "n": {"triton_graphs": {"skipped": "x"}}}}}}
    got = {k: v["met"] for k, v in gpu_check.targets(sections).items()}
    assert got == {"batch1_decode_vs_measured_bound": True, "tok_s_at_256_requests": False,
                   "tok_s_at_32_requests": True, "vs_generate_batch_at_256_requests": True,
                   "exactness_m": False, "exactness_n": None}


def test_dry_run_runs_tensor_parallelism_on_cpu_ranks(dry_run):
    """The dry run's tp section: tp 2 (two CPU processes) against tp 1, exact by vLLM's rule,
    with the all-reduces counted per step (two per layer, one for the embedding)."""
    result = dry_run[0]["sections"]["tensor_parallel"]["result"]
    torch_run = result["torch"]
    assert "error" not in torch_run, torch_run
    assert not torch_run["tp2_vs_tp1"]["failed"]
    run = torch_run["requests_4"]
    assert run["tp1_tok_s"] > 0 and run["tp2_tok_s"] > 0
    assert run["all_reduces_per_step"] == 2 * result["model"]["num_hidden_layers"] + 1
    assert run["all_reduce_kb_per_step"] > 0


def test_the_tp_section_skips_on_one_gpu_and_says_why(monkeypatch):
    plan = dataclasses.replace(gpu_check.gpu_plan())
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ctx = Context(plan, Report(Path("/dev/null"), {}), time.monotonic() + 60)
    with pytest.raises(Skip, match="this device has 1 GPU; tensor parallelism needs 2"):
        gpu_check.section_tensor_parallel(ctx, {})
