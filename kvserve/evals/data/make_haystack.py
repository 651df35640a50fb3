"""Regenerate `haystack_prose.txt`: natural English prose for the long-context recall haystacks.

The text is the Python Language Reference as shipped inside every CPython, in the standard
library module `pydoc_data.topics` (PSF License; see SOURCES.md), so it is available offline
and may be redistributed with its notice. Only prose paragraphs are kept: code examples,
grammar productions, headings, short fragments (list items, captions), tables and
symbol-heavy paragraphs are dropped; *emphasis* markers, footnote markers ([1]) and
whitespace are normalised.

    .venv/bin/python kvserve/evals/data/make_haystack.py            # rewrite the file next to this
    script
    .venv/bin/python kvserve/evals/data/make_haystack.py --check    # exit 1 if the file would
    change

Deterministic for a given CPython release (the topics text changes between releases; the
shipped file was made with the release recorded in SOURCES.md).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

TARGET_CHARS = 150_000
MIN_CHARS = 80  # shorter blocks are list items, captions and one-line fragments
MIN_LINE = 55  # a prose block's wrapped lines are long; code lines mostly are not
SYMBOLS = frozenset("()[]{}<>=_|\\/;#@$%^&~+`")
MAX_SYMBOL_FRACTION = 0.03
ASCII_PUNCT = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                             "\u2013": "-", "\u2014": "-"})
SKIP_PREFIXES = ("Changed in version", "New in version", "Added in version", "Deprecated",
                 "See also", "Note:", "Example")
OUT = Path(__file__).with_name("haystack_prose.txt")


def _normalise(lines: list[str]) -> str:
    text = " ".join(" ".join(lines).split())
    text = re.sub(r"\*\*?([^*\s][^*]*?)\*\*?", r"\1", text)  # *emphasis*, **strong**
    text = re.sub(r"\s*\[\d+\]", "", text)  # footnote markers
    return text.replace('""', '"').translate(ASCII_PUNCT)


def _prose(block: str) -> str | None:
    """The block as one normalised line if it is a paragraph of running text, else None."""
    lines = [line.strip() for line in block.splitlines() if line.strip()]
    if not lines or any(re.fullmatch(r"[*=\-^~]+", line) for line in lines):  # headings
        return None
    if len(lines) > 1 and sum(map(len, lines[:-1])) / (len(lines) - 1) < MIN_LINE:
        return None  # short lines: code, grammar, tables
    text = _normalise(lines)
    if len(text) < MIN_CHARS or not text[0].isupper() or not text.endswith("."):
        return None
    if text.startswith(SKIP_PREFIXES) or not text.isascii():
        return None
    if any(s in text for s in ("::=", ">>>", "...")):
        return None
    return text if sum(c in SYMBOLS for c in text) / len(text) <= MAX_SYMBOL_FRACTION else None


def paragraphs() -> list[str]:
    """Prose paragraphs of every topic in sorted topic order, first occurrence of each only."""
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out: list[str] = []
    for name in sorted(topics):
        for block in re.split(r"\n[ \t]*\n", topics[name]):
            text = _prose(block)
            if text is not None and text not in seen:
                seen.add(text)
                out.append(text)
    return out


def haystack_text(target_chars: int = TARGET_CHARS) -> str:
    """Whole paragraphs, one per line, up to about `target_chars` characters."""
    kept: list[str] = []
    total = 0
    for para in paragraphs():
        if total >= target_chars:
            break
        kept.append(para)
        total += len(para) + 1
    return "\n".join(kept) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description="Regenerate haystack_prose.txt")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    text = haystack_text()
    version = ".".join(map(str, sys.version_info[:3]))
    if args.check:
        same = args.out.exists() and args.out.read_text(encoding="utf-8") == text
        print(f"{'up to date' if same else 'DIFFERS'}: {args.out} (CPython {version})")
        return 0 if same else 1
    args.out.write_text(text, encoding="utf-8")
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"wrote {args.out}: {len(text)} chars, {text.count(chr(10))} paragraphs, "
          f"sha256 {digest}, CPython {version}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
