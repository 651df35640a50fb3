"""argparse `type=` converters shared by the commands: each turns one word of the command line
into a value, or raises ArgumentTypeError with a message that says what was expected (argparse
prints it as a one-line usage error, exit code 2)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any, TypeVar

from kvserve.workers.config import parse_size

T = TypeVar("T")


def seconds(text: str) -> float:
    """'30s', '10m', '1h' or a plain number of seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a duration like 30s or 10m") from None


def words(text: str) -> list[str]:
    """'a,b' -> ['a', 'b']; with a ';' anywhere, ';' separates (so items may contain ',')."""
    sep = ";" if ";" in text else ","
    return [w.strip() for w in text.split(sep) if w.strip()]


def positive_ints(text: str) -> list[int]:
    """'1,8,32' -> [1, 8, 32]: concurrency levels, user counts (at least one, each >= 1)."""
    try:
        values = [int(w) for w in words(text)]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a positive integer or a comma list like 1,8,32")
    return values


def positive_float(text: str) -> float:
    """'0.5' -> 0.5: a rate (users per second), above zero."""
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number above 0, like 0.5 or 8")
    return value


def floats(text: str) -> list[float]:
    """'0,25,50' -> [0.0, 25.0, 50.0]."""
    try:
        return [float(w) for w in words(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give numbers like 0,25,50") from None


def token_lengths(text: str) -> list[int]:
    """'1k,2k,500' -> [1024, 2048, 500] (k = 1,024 tokens: 4k, 8k, 16k are RULER's 4096...)."""
    out = []
    for word in words(text):
        scale = 1024 if word.lower().endswith("k") else 1
        try:
            out.append(int(float(word.lower().removesuffix("k")) * scale))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give token counts like 1k,2k,4k") from None
    return out


def memory_size(text: str) -> int:
    """'2GiB', '512MiB' or a byte count -> bytes."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def json_object(text: str) -> dict[str, Any]:
    """A JSON object, e.g. '{"rope_type": "yarn", "factor": 4.0}'."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"need a JSON object ({{...}}), got {text!r}")
    return value


class _Reset:
    """The word `none` given as an override (`kvserve up --config f.yaml --block-size none`):
    set the setting to None, where a plain None means "not given, keep the file's value"."""

    def __repr__(self) -> str:
        return "none"


RESET: Any = _Reset()


def or_none(convert: Callable[[str], T], none: Any = None) -> Callable[[str], T | None]:
    """`convert`, but the word 'none' gives `none`: None (a setting whose None means "off" or
    "auto"), or `RESET` for an override that must be told apart from a flag not given."""
    def parse(text: str) -> T | None:
        if text.strip().lower() == "none":
            return none
        try:
            return convert(text)
        except ValueError:  # int('x'): argparse would say only "invalid parse value"
            kind = getattr(convert, "__name__", "value")
            raise argparse.ArgumentTypeError(f"{text!r} is not a {kind} (or none)") from None

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def length_counts(text: str) -> dict[int, int]:
    """'4k=2,8k=4' -> {4096: 2, 8192: 4}: a count per token length."""
    out = {}
    for word in words(text):
        length, sep, count = word.partition("=")
        if not sep or not count.strip().isdigit() or int(count) < 1:
            raise argparse.ArgumentTypeError(f"{text!r}: give LENGTH=COUNT pairs like 4k=2,8k=4")
        (n,) = token_lengths(length)
        out[n] = int(count)
    return out


def count_at_length(text: str) -> tuple[int, int]:
    """'3@12k' -> (3, 12288): a count of samples at one token length."""
    count, sep, length = text.partition("@")
    if not sep or not count.strip().isdigit() or int(count) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give COUNT@LENGTH like 3@12k")
    (n,) = token_lengths(length)
    return int(count), n
