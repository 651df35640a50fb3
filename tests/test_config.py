"""One definition of each engine setting (kvserve/workers/config.py), and the front ends agree with
it:
every EngineConfig field is a CLI flag and an AppConfig field with the same default, choices
and bounds, except the differences kvserve.workers.config.ENTRY_POINT_DEFAULTS names; every value
set
on either front end reaches the EngineConfig; the infra configs use only known keys.

Negative controls, checked by hand (each made a test here fail): engine_args skipping one
setting; AppConfig overriding `max_num_seqs` with its own default (32); AppConfig.engine_config()
dropping a key; an EngineConfig field declared without setting(); a serving default changed in
AppConfig without an ENTRY_POINT_DEFAULTS entry; an unknown key in infra/serve/cpu.yaml.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvserve.cli import build_parser
from kvserve.cli.engine_args import engine_config, flag_names
from kvserve.cluster.app import AppConfig
from kvserve.workers.config import (
    ENTRY_POINT_DEFAULTS,
    EngineConfig,
    EngineSetting,
    engine_settings,
    entry_point_defaults,
    parse_size,
)

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = engine_settings()
NAMES = [s.name for s in SETTINGS]


def _sample(spec: EngineSetting) -> Any:
    """A value for `spec` that is not its default and that every front end accepts. A setting
    of a new kind fails here, so the test learns about it."""
    if spec.info.choices:
        return next(c for c in spec.info.choices if c not in (spec.default, "flash_attn", "cpu"))
    if spec.base_type is bool:
        return not spec.default
    if spec.info.memory:
        return "3MiB"
    if spec.base_type is int:
        return 7
    if spec.base_type is float:
        return 0.5
    if spec.base_type is dict:
        return {"rope_type": "linear", "factor": 2.0}
    if spec.base_type is str:
        return "cpu"  # a device, and a (never loaded) model name
    raise AssertionError(f"{spec.name}: no sample for a {spec.type} setting; add one")


SAMPLES = {s.name: _sample(s) for s in SETTINGS}


def _argv(values: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for spec in SETTINGS:
        value, flag = values[spec.name], flag_names(spec)[0]
        if spec.base_type is bool:
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _subparser(*path: str) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = sub.choices[name]
    return parser


def _engine_actions(*path: str) -> dict[str, argparse.Action]:
    return {a.dest: a for a in _subparser(*path)._actions if a.dest in NAMES}


def test_every_setting_is_defined_once_with_help():
    assert list(EngineConfig.__dataclass_fields__) == NAMES
    for spec in SETTINGS:
        assert len(spec.info.help) > 10, spec.name
    EngineConfig()  # the defaults pass the settings' own checks


@pytest.mark.parametrize("command", [("generate",), ("bench", "throughput"), ("bench", "prefix")])
def test_every_setting_is_an_in_process_flag_with_the_same_default_and_choices(command):
    actions = _engine_actions(*command)
    assert set(actions) == set(NAMES), set(NAMES) ^ set(actions)
    for spec in SETTINGS:
        action = actions[spec.name]
        assert action.default == spec.default, spec.name
        assert tuple(action.choices or ()) == (spec.info.choices or ()), spec.name
        assert spec.info.help.replace("%", "%%") in action.help, spec.name


def test_every_flag_reaches_the_engine_config():
    """The mapper passes all of them: today's bug was a hand-written subset (no
    --itl-target-ms, no --max-model-len)."""
    args = build_parser().parse_args(["generate", "hi", *_argv(SAMPLES)])
    assert engine_config(args) == EngineConfig(**SAMPLES)
    assert engine_config(build_parser().parse_args(["generate", "hi"])) == EngineConfig()


def test_optional_settings_take_none_and_memory_sizes_parse():
    args = build_parser().parse_args(["generate", "hi", "--max-expected-wait-s", "none",
                                      "--kv-cache-memory", "1.5GiB", "--prefix-caching",
                                      "--rope-parameters", '{"rope_type": "yarn", "factor": 4}'])
    config = engine_config(args)
    assert config.max_expected_wait_s is None
    assert config.kv_cache_memory == parse_size("1.5GiB") == 3 * 2**29
    assert config.enable_prefix_caching is True
    assert config.rope_parameters == {"rope_type": "yarn", "factor": 4}


@pytest.mark.parametrize("argv, flag", [
    (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
    (["--rope-parameters", "[1]"], "--rope-parameters"),
    (["--block-size", "x"], "--block-size"),
    (["--dtype", "fp8"], "--dtype"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["generate", "hi", *argv])
    assert exit_.value.code == 2 and flag in capsys.readouterr().err


def test_a_value_the_config_refuses_names_the_setting(capsys):
    args = build_parser().parse_args(["generate", "hi", "--max-num-seqs", "0"])
    with pytest.raises(SystemExit) as exit_:
        engine_config(args)
    assert exit_.value.code == 2 and "max_num_seqs must be positive" in capsys.readouterr().err


def test_every_setting_is_an_app_config_field_with_the_same_default_but_the_named_ones():
    fields = AppConfig.model_fields
    assert set(NAMES) <= set(fields), set(NAMES) - set(fields)
    engine = EngineConfig.__dataclass_fields__
    differs = {n for n in NAMES if fields[n].default != engine[n].default}
    assert differs == set(ENTRY_POINT_DEFAULTS["serve"])
    for name, difference in ENTRY_POINT_DEFAULTS["serve"].items():
        assert fields[name].default == difference.value, name
        assert difference.why, name


def test_app_config_engine_config_round_trips_every_setting():
    config = AppConfig.model_validate(SAMPLES)
    assert set(config.engine_config()) == set(NAMES)
    assert EngineConfig(**config.engine_config()) == EngineConfig(**SAMPLES)
    served = EngineConfig(**AppConfig().engine_config())
    assert served == EngineConfig(**entry_point_defaults("serve"))


def test_kvserve_up_flags_override_every_setting(monkeypatch):
    import kvserve.cli.launch
    from kvserve.cli import main

    seen = {}
    monkeypatch.setattr(kvserve.cli.launch, "serve_until_interrupted",
                        lambda path, overrides, port, http_port, nodes: seen.update(
                            config=kvserve.cli.launch.load_config(path, overrides)) or 0)
    assert main(["up", "--config", str(ROOT / "infra/serve/cpu.yaml"), *_argv(SAMPLES)]) == 0
    assert EngineConfig(**seen["config"].engine_config()) == EngineConfig(**SAMPLES)
    assert main(["up"]) == 0  # no flag given: AppConfig's (serving's) defaults
    assert seen["config"] == AppConfig()
    actions = _engine_actions("up")
    assert set(actions) == set(NAMES) and all(a.default is None for a in actions.values())


def test_kvserve_deploy_takes_every_application_flag_up_takes(monkeypatch, tmp_path):
    """`kvserve deploy` replaces the running config whole, so it must be able to say all that
    `up` said: API keys, Redis, tracing and every engine setting; only where and how the
    cluster starts (ports, local nodes, --detach) is up's alone."""
    import kvserve.cli.launch
    from kvserve.cli import main

    up_only = {"grpc_port", "http_port", "local_nodes", "gpus_per_node", "cpus_per_node",
               "dashboard", "detach"}
    up = {a.dest: a.option_strings for a in _subparser("up")._actions}
    deploy = {a.dest: a.option_strings for a in _subparser("deploy")._actions}
    assert {d: o for d, o in up.items() if d not in up_only} == {
        d: o for d, o in deploy.items() if d != "address"}
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))  # where --api-key's file goes
    seen = {}
    monkeypatch.setattr(kvserve.cli.launch, "redeploy", lambda path, overrides, address:
                        seen.update(config=kvserve.cli.launch.load_config(path, overrides)) or 0)
    assert main(["deploy", "--api-key", "sk-a:team", "--redis-url", "redis://h:1",
                 "--otlp-traces-endpoint", "h:4317", "--replicas", "2",
                 *_argv(SAMPLES)]) == 0
    config = seen["config"]
    assert (config.redis_url, config.otlp_traces_endpoint, config.replicas) == (
        "redis://h:1", "h:4317", 2)
    assert "sk-a" in Path(config.api_keys_file).read_text()
    assert EngineConfig(**config.engine_config()) == EngineConfig(**SAMPLES)


def test_kvserve_up_none_resets_a_config_files_value_and_an_absent_flag_keeps_it(
        monkeypatch, tmp_path):
    import kvserve.cli.launch
    from kvserve.cli import main

    seen: dict[str, Any] = {}
    monkeypatch.setattr(kvserve.cli.launch, "serve_until_interrupted",
                        lambda path, overrides, port, http_port, nodes: seen.update(
                            config=kvserve.cli.launch.load_config(path, overrides)) or 0)
    path = tmp_path / "app.yaml"
    path.write_text("block_size: 32\nmax_model_len: 2048\n")
    assert main(["up", "--config", str(path)]) == 0
    assert (seen["config"].block_size, seen["config"].max_model_len) == (32, 2048)
    assert main(["up", "--config", str(path), "--block-size", "none"]) == 0
    assert (seen["config"].block_size, seen["config"].max_model_len) == (None, 2048)


def test_eval_pool_default_is_the_named_one():
    actions = _engine_actions("eval", "recall")
    assert set(actions) == {"model", "kv_cache_memory", "enable_prefix_caching", "max_num_seqs",
                            "tensor_parallel_size", "tp_step_channel", "num_threads"}
    assert actions["kv_cache_memory"].default == ENTRY_POINT_DEFAULTS["eval"][
        "kv_cache_memory"].value
    args = build_parser().parse_args(["eval", "factuality"])
    assert parse_size(args.kv_cache_memory) == 4 * 2**30


def _infra_app_configs() -> list[tuple[str, dict]]:
    configs = []
    for path in sorted((ROOT / "infra" / "serve").glob("*.yaml")):
        configs.append((path.name, yaml.safe_load(path.read_text())))
    for doc in yaml.safe_load_all((ROOT / "infra" / "k8s" / "rayservice.yaml").read_text()):
        if doc and doc.get("kind") == "RayService":
            configs.append(("rayservice", yaml.safe_load(doc["spec"]["serveConfigV2"])))
    args = [(f"{name}:{app['name']}", app.get("args") or {})
            for name, config in configs for app in config["applications"]]
    baseline = ROOT / "infra" / "locust" / "baseline" / "app.yaml"  # a bare AppConfig
    return [*args, ("locust/baseline/app.yaml", yaml.safe_load(baseline.read_text()))]


@pytest.mark.parametrize("name, args", _infra_app_configs(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_infra_configs_use_only_known_keys_and_validate(name, args):
    assert set(args) <= set(AppConfig.model_fields), set(args) - set(AppConfig.model_fields)
    config = AppConfig.model_validate(args)
    written = {k: v for k, v in args.items() if k in NAMES}
    assert EngineConfig(**config.engine_config()) == EngineConfig(
        **entry_point_defaults("serve") | written)
