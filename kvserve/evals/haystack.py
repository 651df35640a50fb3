"""Haystacks for the long-context recall tasks, as lists of sentences.

Needles are inserted between sentences, so every haystack is handled as a sequence of whole
sentences (each ending in ".", "!" or "?", possibly followed by a closing quote or bracket):

* ``noise``: the Landmark-Attention / RULER filler, the five sentences of `NOISE` repeated.
* ``prose``: natural English prose shipped in `kvserve/evals/data/haystack_prose.txt` (the Python
  Language Reference text from CPython's `pydoc_data.topics`, PSF License; see
  `kvserve/evals/data/SOURCES.md`), one paragraph per line, repeated when a prompt needs more.
* any other string: the text of a user's file, split the same way.
"""

from __future__ import annotations

import re
from functools import lru_cache
from importlib import resources

NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again.")
PROSE_FILE = "haystack_prose.txt"

# Words that end in "." without ending a sentence (compared lower-case, without the dot).
_ABBREVIATIONS = frozenset({
    "e.g", "i.e", "etc", "vs", "cf", "al", "mr", "mrs", "ms", "dr", "prof", "st", "no", "fig",
    "sec", "ch", "vol", "approx", "resp", "esp", "viz",
})
# A candidate boundary: terminal punctuation, optional closers, whitespace, then a capital,
# a digit or an opening quote/bracket.
_BOUNDARY = re.compile(r"[.!?][\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*$")


def ends_sentence(text: str) -> bool:
    """Whether `text` (trailing whitespace ignored) ends with a sentence terminator."""
    return bool(_SENTENCE_END.search(text.rstrip()))


def _is_abbreviation(text: str, dot: int) -> bool:
    """Whether the "." at `dot` closes an abbreviation or an initial rather than a sentence."""
    word = text[:dot].rsplit(None, 1)[-1] if text[:dot].strip() else ""
    word = word.lstrip("\"'([").lower()
    return word in _ABBREVIATIONS or (len(word) == 1 and word.isalpha())


def split_sentences(paragraph: str) -> list[str]:
    """Split one paragraph into sentences; the pieces joined by " " give back the paragraph
    with its whitespace normalised. Text after the last terminator stays a sentence of its own."""
    text = " ".join(paragraph.split())
    sentences: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        if text[m.start()] == "." and _is_abbreviation(text, m.start()):
            continue
        sentences.append(text[start:m.end()].rstrip())
        start = m.end()
    if text[start:].strip():
        sentences.append(text[start:].strip())
    return sentences


def _split_text(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Sentences of a text and the indices where its paragraphs start. Paragraphs are
    separated by blank lines, or are single lines when the text has no blank lines."""
    blocks = re.split(r"\n[ \t]*\n", text) if re.search(r"\n[ \t]*\n", text) else text.splitlines()
    sentences: list[str] = []
    starts: list[int] = []
    for block in blocks:
        pieces = [s for s in split_sentences(block) if ends_sentence(s)]
        if pieces:
            starts.append(len(sentences))
            sentences.extend(pieces)
    if not sentences:
        raise ValueError("the haystack text has no complete sentence")
    return tuple(sentences), tuple(starts)


@lru_cache(maxsize=1)
def prose_text() -> str:
    """The shipped prose, one paragraph per line."""
    return resources.files("kvserve.evals").joinpath("data", PROSE_FILE).read_text(encoding="utf-8")


@lru_cache(maxsize=8)
def haystack_sentences(haystack: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(sentences, paragraph start indices) of "noise", "prose" or a user's text.
    Fragments without a sentence terminator are dropped, so every sentence ends one."""
    if haystack == "noise":
        sentences, _ = _split_text(NOISE)
        return sentences, (0,)
    if haystack == "prose":
        return _split_text(prose_text())
    return _split_text(haystack)
