"""The engine flags, generated from `kvserve.workers.config.EngineConfig`'s settings (as vLLM's
EngineArgs.add_cli_args does), so every engine setting is a flag with the definition's type,
default, choices and help, and nothing about a setting is written here by hand.

`--kv-cache-memory 2GiB` parses memory sizes; a boolean setting is a pair of flags
(`--enable-prefix-caching` / `--no-enable-prefix-caching`, and for `enable_X` also `--X` /
`--no-X`); an optional setting also takes the word `none`; `--rope-parameters` takes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Collection
from typing import Any

from kvserve.cli.types import RESET, json_object, memory_size, or_none
from kvserve.workers.config import (
    EngineConfig,
    EngineSetting,
    engine_settings,
    entry_point_defaults,
    format_size,
)


def flag_names(spec: EngineSetting) -> list[str]:
    """The option strings of one setting (without the --no- forms argparse adds for bools)."""
    names = ["--" + spec.name.replace("_", "-")]
    if spec.base_type is bool and spec.name.startswith("enable_"):
        names.append("--" + spec.name.removeprefix("enable_").replace("_", "-"))
    names += SHORT_FLAGS.get(spec.name, [])
    return names


# vLLM's short forms
SHORT_FLAGS = {"tensor_parallel_size": ["-tp"]}


def add_engine_args(parser: argparse.ArgumentParser, entry_point: str | None = None, *,
                    overrides: bool = False, only: Collection[str] | None = None) -> None:
    """Add a flag per engine setting to `parser`, in an "engine" group.

    `entry_point`: whose defaults (kvserve.workers.config.ENTRY_POINT_DEFAULTS; None: the in-process
    engine's). `overrides`: every flag defaults to None, so only the flags given override a
    config file (`kvserve up --config`), and the word none gives `RESET` (set it to None).
    `only`: just these settings.
    """
    group = parser.add_argument_group(
        "engine", "engine settings (kvserve.workers.config.EngineConfig); an optional one also "
                  "takes the word none")
    defaults = entry_point_defaults(entry_point)
    for spec in engine_settings():
        if only is not None and spec.name not in only:
            continue
        shown = _show(spec, defaults[spec.name])
        default_help = f"from --config, else {shown}" if overrides else shown
        kwargs: dict[str, Any] = {
            "dest": spec.name, "default": None if overrides else defaults[spec.name],
            "help": f"{spec.info.help} (default: {default_help})".replace("%", "%%")}
        if spec.base_type is bool:
            group.add_argument(*flag_names(spec), action=argparse.BooleanOptionalAction,
                               **kwargs)
            continue
        convert: Any = (memory_size if spec.info.memory else json_object
                        if spec.base_type is dict else spec.base_type)
        if spec.optional and convert is not str:
            convert = or_none(convert, RESET if overrides else None)
        group.add_argument(*flag_names(spec), type=convert, choices=spec.info.choices,
                           metavar=_metavar(spec), **kwargs)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the parser has flags for, by name (EngineConfig's keywords)."""
    return {s.name: getattr(args, s.name) for s in engine_settings() if hasattr(args, s.name)}


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from every engine flag. A value the config refuses (e.g. --max-num-seqs 0)
    ends the command with one line naming the setting, exit code 2, as argparse's own errors."""
    try:
        return EngineConfig(**engine_kwargs(args))
    except ValueError as exc:
        print(f"kvserve: invalid engine setting: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _show(spec: EngineSetting, value: Any) -> str:
    if value is None:
        return "none"
    if spec.base_type is bool:
        return "on" if value else "off"
    if spec.info.memory:
        return format_size(value)
    if isinstance(value, dict):
        return json.dumps(value)
    return str(value)


def _metavar(spec: EngineSetting) -> str | None:
    if spec.info.choices:
        return None  # argparse shows {a,b,c}
    if spec.info.memory:
        return "SIZE"
    if spec.base_type is dict:
        return "JSON"
    return {int: "N", float: "X"}.get(spec.base_type, spec.name.upper())
