"""`kvserve bench gpu-compile`: kvserve's Triton kernels compiled for real GPUs on this CPU-only
machine (Triton's bundled ptxas, no driver), each checked for shared memory against the GPU's
limit, register spills and tensor-core instructions; with negative controls for each check.

The command runs in a subprocess without TRITON_INTERPRET (the suite sets it for the
interpreter tests, and kernels made for the interpreter cannot be compiled)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.bench import gpu_compile

ROOT = Path(__file__).resolve().parent.parent
KERNEL_MODULES = ("kvserve/workers/model_executor/attention/triton_kernels.py",
                  "kvserve/workers/model_executor/triton_ops.py")


# the three runs, in one process (each start imports torch and triton: seconds of CI): the
# engine's picks; the attention dots forced to fp32 FMA; tiles over sm_80's shared memory
# (last: it changes the selection logic's constants in that process)
RUNS = """
import json, sys
from kvserve.cli import main
from kvserve.workers.model_executor.attention import triton_kernels as tk

out, codes = sys.argv[1], {}
def run(name, *flags):
    sys.argv = ["kvserve", "bench", "gpu-compile", *flags, "--jobs", "1", "--json",
                "--out", f"{out}/{name}.json"]
    codes[name] = main(sys.argv[1:])
run("ci", "--ci")
run("dot_fp32", "--shapes", "smollm2-135m", "--tp", "1", "--dtypes", "bfloat16",
    "--block-sizes", "16", "--gpus", "sm_90", "--kernels",
    "attention decode,attention prefill,rms_norm", "--dot-fp32")
tk.PREFILL_BLOCK_N = 256
tk.NUM_STAGES = 4
run("oversized", "--shapes", "llama-3.1-8b", "--tp", "8", "--dtypes", "bfloat16",
    "--block-sizes", "16", "--gpus", "sm_80", "--kernels", "attention prefill,rms_norm")
json.dump(codes, open(f"{out}/codes.json", "w"))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[int, dict]]:
    """name -> (exit code, JSON report) of each run of RUNS."""
    out = tmp_path_factory.mktemp("gpu-compile")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", RUNS, str(out)], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert (out / "codes.json").exists(), done.stderr[-3000:]
    codes = json.loads((out / "codes.json").read_text())
    return {name: (code, json.loads((out / f"{name}.json").read_text()))
            for name, code in codes.items()}


def _launched_kernels() -> set[str]:
    """Every `@triton.jit` function kvserve launches (the kernels; helpers they call are not)."""
    names = set()
    for module in KERNEL_MODULES:
        names |= set(re.findall(r"@triton\.jit\ndef (_\w+_kernel)\(", (ROOT / module).read_text()))
    return names


@pytest.mark.slow
def test_the_engines_picks_for_smollm2_and_llama_1b_compile_for_hopper_within_its_limits(
        runs):
    """What `make gpu-check` runs on an H100/H200 (SmolLM2 and Llama-3.2-1B's shape at tp 1,
    the 1B's at tp 2 too, bf16), compiled for sm_90: every kernel kvserve launches, none over the
    227 KiB shared-memory limit, no spills, tensor-core instructions in both attention
    kernels (wgmma for prefill's 64-row tiles; mma.sync for decode's 16)."""
    rc, report = runs["ci"]
    assert rc == 0, [r for r in report["rows"] if not r["ok"]]
    rows = report["rows"]
    assert {r["function"] for r in rows} == _launched_kernels()
    assert report["versions"]["ptxas"]["sm_90"]
    # 7 kernels x (SmolLM2 tp 1, the 1B at tp 1 and 2), less the launches they share
    assert report["failed"] == 0 and len(rows) == report["configs"] >= 14
    for r in rows:
        assert r["gpu"] == "sm_90" and r["dtype"] == "bfloat16"
        assert r["shared_bytes"] <= r["shared_limit"] == 227 * 1024
        assert r["spill_stores"] == r["spill_loads"] == 0
        assert 0 < r["registers"] <= 255 and r["blocks_per_sm"] >= 1
    by_kernel = {r["kernel"]: r for r in rows}
    assert set(by_kernel) == {"attention decode", "attention merge", "attention prefill",
                              "rotary + kv write", "rms_norm", "rms_norm + residual",
                              "silu_and_mul"}
    assert all("wgmma.mma_async" in r["tensor_core_ops"] for r in rows
               if r["kernel"] == "attention prefill")
    assert all("mma.sync" in r["tensor_core_ops"] for r in rows
               if r["kernel"] == "attention decode")
    assert all(not r["dot_operands"] and not r["tensor_core_ops"] for r in rows
               if not r["kernel"].startswith("attention ") or r["kernel"] == "attention merge")
    # the tiles come from the selection logic: decode's 16 rows, prefill's 64 (GQA group 3
    # and 4 of SmolLM2 and Llama-3.2-1B)
    assert {r["BLOCK_M"] for r in rows if r["kernel"] == "attention decode"} == {16}
    assert {(r["GROUP"], r["BLOCK_Q"]) for r in rows if r["kernel"] == "attention prefill"} \
        == {(3, 21), (4, 16)}
    assert any(r["example"].startswith("llama-3.2-1b tp2") for r in rows)


@pytest.mark.slow
def test_an_oversized_tile_is_reported_over_the_limit_and_fails_the_command(runs):
    """Negative control for the shared-memory check: prefill tiles of 256 keys with 4 stages at
    head dim 128 ask for ~177 KiB on an A100, over its 163 KiB (~274 KiB on an H100, over its
    227); Triton compiles them without complaint, the check must not."""
    rc, report = runs["oversized"]
    assert rc == 1
    prefill = [r for r in report["rows"] if r["kernel"] == "attention prefill"]
    assert [r["gpu"] for r in prefill] == ["sm_80"]
    for r in prefill:
        assert r["BLOCK_N"] == 256 and r["num_stages"] == 4
        assert r["shared_bytes"] > r["shared_limit"] and not r["ok"]
        assert any("over the" in p for p in r["problems"])
    assert [r["ok"] for r in report["rows"] if r["kernel"] == "rms_norm"] == [True]


@pytest.mark.slow
def test_attention_forced_to_fp32_fma_is_reported_without_tensor_cores_and_fails(runs):
    """Negative control for the tensor-core check: the attention dots forced to fp32 FMA (what
    the CPU interpreter runs) on a bf16 model compile to no mma/wgmma, and the command says so
    and fails; kernels without tl.dot are not affected."""
    rc, report = runs["dot_fp32"]
    assert rc == 1
    for r in report["rows"]:
        if r["kernel"] in ("attention decode", "attention prefill"):
            assert r["dot_operands"] == ["f32"] and r["tensor_core_ops"] == []
            assert "tl.dot (f32 operands) without tensor-core instructions" in r["problems"]
        else:
            assert r["ok"], r
    summary = {s["kernel"]: s["tensor_cores"] for s in report["summary"]}
    assert summary["attention prefill"] == "NONE"
    assert summary["rms_norm"] == "no tl.dot"


def test_the_sweep_covers_each_shapes_tp_sizes_and_refuses_unknown_names(capsys):
    """The shapes' tp sizes divide their heads and KV heads (what the engine accepts); an
    unknown shape or GPU is a usage error naming the flag."""
    for name, shape in gpu_compile.SHAPES.items():
        assert shape.tp_sizes[0] == 1, name
        for tp in shape.tp_sizes:
            assert shape.heads % tp == shape.kv_heads % tp == shape.intermediate % tp == 0
    assert {s.head_dim for s in gpu_compile.SHAPES.values()} == {64, 96, 128, 256}
    assert any(s.softcap for s in gpu_compile.SHAPES.values())  # its own attention compile
    from kvserve.cli import main

    assert main(["bench", "gpu-compile", "--gpus", "sm_75"]) == 2
    assert "--gpus: unknown sm_75" in capsys.readouterr().err
    assert main(["bench", "gpu-compile", "--shapes", "gpt-5"]) == 2
    assert "--shapes: unknown gpt-5" in capsys.readouterr().err
    assert main(["bench", "gpu-compile", "--kernels", "attention"]) == 2
    assert "--kernels: unknown attention (known: attention decode," in capsys.readouterr().err
