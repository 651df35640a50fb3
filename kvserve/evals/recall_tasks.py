"""Long-context recall samples, RULER-style: passkey and four needle-in-a-haystack variants.

Every sample is plain text (no chat template) that ends where the model should answer, sized
with the model's own tokenizer so the whole prompt is within 1% of the requested token length
(and never above it by more than 1%), with its needle(s) at the requested depth on a sentence
boundary. Everything is drawn from `random.Random(f"{seed}:{task}:{length}:{depth:g}:{index}")`
(a string seed, never `hash()`), so a sample is a pure function of its arguments and the
tokenizer. The haystack is not in the seed: the same arguments over "noise" and "prose" hide
the same needles.

Templates (after Landmark Attention, Mohtashami & Jaggi 2023, and RULER, Hsieh et al. 2024):

passkey (the value is a random 5-digit number; Landmark draws 1..50000, a fixed width keeps
the answer's token count steady)::

    There is an important info hidden inside a lot of irrelevant text. Find it and memorize
    them. I will quiz you about the important information there.
    {haystack ... The pass key is {N}. Remember it. {N} is the pass key. ... haystack}
    What is the pass key? The pass key is

niah_* (needle ``One of the special magic {kind} for {key} is: {value}.``; kind is numbers,
words or uuids; the singular wording when a single value is asked for, as RULER does)::

    A special magic number is hidden within the following text. Make sure to memorize it.
    I will quiz you about the number afterwards.
    {haystack with needles}
    What is the special magic number for {key} mentioned in the provided text? The special
    magic number for {key} mentioned in the provided text is

    Some special magic numbers are hidden within the following text. ... the numbers
    afterwards. ... What are all the special magic numbers for {keys} mentioned in the
    provided text? The special magic numbers for {keys} mentioned in the provided text are

Tasks (RULER's configurations): ``niah_single`` one needle; ``niah_multikey`` the needle
plus 3 distractor needles with other keys, at random sentence boundaries; ``niah_multivalue``
4 needles with the same key, all 4 values asked for; ``niah_multiquery`` 4 keys, all asked
for at once ("a, b, c, and d"). Keys are adjective-noun words ("quiet-harbor"); values are
7-digit numbers, adjective-noun words or UUID4 strings. The asked-for needles sit together,
in random order, at the requested depth; only multikey's distractors are spread out.

Sizing: the haystack's sentences are tokenized once (each with its leading space, as they
are joined), the template with its needles and no haystack is tokenized once, and the
number of haystack sentences that fits the remaining budget is found by binary search on
cumulative token counts (the haystack repeats as often as needed). The remainder (less than
one sentence) is filled with whole sentences of the right token counts from the same
haystack, so the needle still sits between sentences. One tokenization of the full prompt
then checks the count; the budget is corrected and the fit redone if token merges across
joins moved it.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvserve.evals.haystack import haystack_sentences

TASKS = ("passkey", "niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery")
VALUE_KINDS = ("numbers", "words", "uuids")

PASSKEY_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize "
    "them. I will quiz you about the important information there."
)
PASSKEY_NEEDLE = "The pass key is {value}. Remember it. {value} is the pass key."
PASSKEY_QUESTION = "What is the pass key? The pass key is"

NIAH_NEEDLE = "One of the special magic {kinds} for {key} is: {value}."
NIAH_INTRO = {
    False: "A special magic {kind} is hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {kind} afterwards.",
    True: "Some special magic {kind} are hidden within the following text. Make sure to "
    "memorize it. I will quiz you about the {kind} afterwards.",
}
NIAH_QUESTION = {
    False: "What is the special magic {kind} for {query} mentioned in the provided text? "
    "The special magic {kind} for {query} mentioned in the provided text is",
    True: "What are all the special magic {kind} for {query} mentioned in the provided text? "
    "The special magic {kind} for {query} mentioned in the provided text are",
}
# (number of keys in the haystack, values per key, keys asked for) as in RULER's configs.
NIAH_SHAPES = {
    "niah_single": (1, 1, 1),
    "niah_multikey": (4, 1, 1),
    "niah_multivalue": (1, 4, 1),
    "niah_multiquery": (4, 1, 4),
}
_SINGULAR = {"numbers": "number", "words": "word", "uuids": "uuid"}

_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "bright", "calm", "clever", "cold",
    "crimson", "curious", "dusty", "eager", "faint", "fancy", "fierce", "gentle", "golden",
    "grand", "hidden", "hollow", "humble", "icy", "jolly", "kind", "lively", "lonely", "lucky",
    "mellow", "misty", "noble", "odd", "pale", "proud", "quiet", "rapid", "rough", "rusty",
    "sharp", "shy", "silent", "silver", "sleepy", "smooth", "sour", "steady", "stormy", "sunny",
    "swift", "tall", "tender", "tiny", "vivid", "warm", "wild", "windy", "wise", "young"
)
_NOUNS = (
    "anchor", "apple", "arrow", "badge", "basket", "beacon", "bell", "bridge", "candle",
    "canyon", "castle", "cedar", "cloud", "comet", "compass", "copper", "crown", "desert",
    "dragon", "engine", "falcon", "feather", "forest", "fountain", "garden", "glacier",
    "harbor", "hammer", "island", "jacket", "kettle", "ladder", "lantern", "lemon", "marble",
    "meadow", "mirror", "needle", "orchard", "otter", "pebble", "pepper", "piano", "pillow",
    "planet", "quill", "river", "saddle", "shadow", "spider", "spoon", "tiger", "tower",
    "valley", "violin", "walnut", "whistle", "willow", "window"
)


@dataclass(frozen=True)
class RecallSample:
    """One prompt of a recall task and what its answer must contain."""

    task: str
    length: int  # the requested prompt length in tokens
    depth: float  # where the asked-for needle(s) sit, 0 (start) to 100 (end) of the haystack
    index: int
    seed: int
    prompt: str  # the whole prompt, plain text, ending where the model should answer
    targets: tuple[str, ...]  # the values to recall
    max_tokens: int  # generation budget for the answer
    # len(tokenizer(prompt)["input_ids"]), as kvserve.workers.core.inputs counts it
    prompt_tokens: int

    @property
    def sample_id(self) -> str:
        """First 16 hex digits of the prompt's sha256."""
        return hashlib.sha256(self.prompt.encode("utf-8")).hexdigest()[:16]


@dataclass(frozen=True)
class _Layout:
    """A sample's text apart from its haystack."""

    intro: str
    question: str
    needles: tuple[str, ...]  # asked-for needles, inserted together at the depth
    distractors: tuple[tuple[float, str], ...]  # (fraction of the haystack, needle)
    targets: tuple[str, ...]


def build_sample(
    task: str,
    tokenizer: Any,
    length: int,
    depth: float,
    index: int,
    seed: int,
    haystack: str = "noise",
    value_kind: str = "numbers",
) -> RecallSample:
    """Build sample `index` of `task` at `length` tokens with its needle at `depth` percent.

    `haystack` is "noise", "prose" or the text of a user's file; `value_kind` is numbers,
    words or uuids (passkey always uses numbers). Raises ValueError for unknown arguments or
    a length the prompt cannot fit within 1%."""
    _check_args(task, length, depth, value_kind)
    rng = random.Random(f"{seed}:{task}:{length}:{float(depth):g}:{index}")
    layout = _passkey_layout(rng) if task == "passkey" else _niah_layout(task, value_kind, rng)
    prompt, n_tokens = _fit(tokenizer, layout, length, depth, haystack, rng)
    return RecallSample(
        task=task, length=length, depth=float(depth), index=index, seed=seed, prompt=prompt,
        targets=layout.targets, max_tokens=_answer_budget(tokenizer, layout.targets),
        prompt_tokens=n_tokens,
    )


def _check_args(task: str, length: int, depth: float, value_kind: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    if value_kind not in VALUE_KINDS:
        raise ValueError(f"unknown value_kind {value_kind!r}; expected one of {VALUE_KINDS}")
    if not 0 <= depth <= 100:
        raise ValueError(f"depth must be within [0, 100] percent, got {depth}")
    if length <= 0:
        raise ValueError(f"length must be positive, got {length}")


# --- needles and templates -------------------------------------------------------------


def _passkey_layout(rng: random.Random) -> _Layout:
    value = str(rng.randint(10_000, 99_999))
    needle = PASSKEY_NEEDLE.format(value=value)
    return _Layout(PASSKEY_INTRO, PASSKEY_QUESTION, (needle,), (), (value,))


def _niah_layout(task: str, kind: str, rng: random.Random) -> _Layout:
    n_keys, n_values, n_asked = NIAH_SHAPES[task]
    words = rng.sample(range(len(_ADJECTIVES) * len(_NOUNS)), n_keys * (1 + n_values))
    keys = [_word(i) for i in words[:n_keys]]  # word values never repeat a key
    flat = _distinct_values(kind, rng, iter(words[n_keys:]), n_keys * n_values)
    values = [flat[k * n_values:(k + 1) * n_values] for k in range(n_keys)]
    asked = sorted(rng.sample(range(n_keys), n_asked))
    needles = [NIAH_NEEDLE.format(kinds=kind, key=keys[k], value=v)
               for k in asked for v in values[k]]
    rng.shuffle(needles)
    distractors = tuple(
        (rng.random(), NIAH_NEEDLE.format(kinds=kind, key=keys[k], value=v))
        for k in range(n_keys) if k not in asked for v in values[k]
    )
    many = n_asked * n_values > 1
    noun = kind if many else _SINGULAR[kind]
    query = _join_keys([keys[k] for k in asked])
    return _Layout(
        NIAH_INTRO[many].format(kind=noun), NIAH_QUESTION[many].format(kind=noun, query=query),
        tuple(needles), distractors, tuple(v for k in asked for v in values[k]),
    )


def _word(i: int) -> str:
    return f"{_ADJECTIVES[i // len(_NOUNS)]}-{_NOUNS[i % len(_NOUNS)]}"


def _distinct_values(kind: str, rng: random.Random, spare_words: Iterator[int],
                     n: int) -> list[str]:
    """`n` different values: 7-digit numbers, unused adjective-noun words, or UUID4s."""
    values: list[str] = []
    while len(values) < n:
        if kind == "numbers":
            value = str(rng.randint(1_000_000, 9_999_999))
        elif kind == "words":
            value = _word(next(spare_words))
        else:
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if value not in values:
            values.append(value)
    return values


def _join_keys(keys: list[str]) -> str:
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _answer_budget(tokenizer: Any, targets: Sequence[str]) -> int:
    """Tokens for the targets as a list, plus half again (at least 8), rounded up to 8."""
    needed = len(tokenizer(" " + ", ".join(targets) + ".", add_special_tokens=False)["input_ids"])
    budget = needed + max(8, needed // 2)
    return -(-budget // 8) * 8


# --- sizing ----------------------------------------------------------------------------


def _count(tokenizer: Any, text: str) -> int:
    """Prompt tokens exactly as kvserve.workers.core.inputs.to_token_ids(prompt=...) counts them."""
    return len(tokenizer(text)["input_ids"])


def _assemble(layout: _Layout, sentences: list[str], lengths: list[int], depth: float) -> str:
    """The prompt: needles at the sentence boundary nearest `depth` percent of the haystack's
    tokens, distractors at their own fractions."""
    cum = list(itertools.accumulate(lengths, initial=0))
    boundary = _nearest_boundary(cum, depth / 100)
    inserts = [(boundary, 0, needle) for needle in layout.needles]
    inserts += [(_nearest_boundary(cum, f), 1, d) for f, d in layout.distractors]
    pieces = list(sentences)
    for pos, _, needle in sorted(inserts, key=lambda x: (-x[0], -x[1])):
        pieces.insert(pos, needle)  # from the end, so earlier positions stay valid
    return f"{layout.intro}\n{' '.join(pieces)}\n{layout.question}"


def _nearest_boundary(cum: list[int], fraction: float) -> int:
    """Index k (0..len(cum)-1) whose cumulative token count is nearest `fraction` of the total."""
    target = fraction * cum[-1]
    k = bisect.bisect_left(cum, target)
    if k == len(cum) or (k > 0 and target - cum[k - 1] <= cum[k] - target):
        k -= 1
    return k


def _fit(tokenizer: Any, layout: _Layout, length: int, depth: float, haystack: str,
         rng: random.Random) -> tuple[str, int]:
    """The prompt within 1% of `length` tokens (never above by more than 1%) and its count."""
    sentences, starts = haystack_sentences(haystack)
    lengths = _sentence_lengths(tokenizer, haystack, sentences)
    start = rng.choice(starts)
    tol = int(length * 0.01)
    overhead = _count(tokenizer, _assemble(layout, [], [], depth))
    budget = length - overhead
    best: tuple[int, str] | None = None
    for _ in range(4):
        order = _choose(lengths, start, max(budget, 0), tol)
        prompt = _assemble(layout, [sentences[i] for i in order],
                           [lengths[i] for i in order], depth)
        n = _count(tokenizer, prompt)
        if best is None or _miss(n, length) < _miss(best[0], length):
            best = (n, prompt)
        if length - tol <= n <= length:
            break
        budget += length - n
    n, prompt = best
    if abs(n - length) > length * 0.01:
        raise ValueError(f"cannot fit a {length}-token prompt within 1% (got {n}; the prompt "
                         f"without haystack takes {overhead} tokens)")
    return prompt, n


def _miss(n: int, length: int) -> tuple[bool, int]:
    """How far `n` tokens are from `length`, preferring not to exceed it."""
    return n > length, abs(length - n)


def _choose(lengths: Sequence[int], start: int, budget: int, tol: int) -> list[int]:
    """Sentence indices whose token counts sum to within `tol` below `budget`: as many whole
    sentences as fit, in order from `start` (cycling), then fillers for the remainder."""
    n = len(lengths)
    rotated = [(start + i) % n for i in range(n)]
    cum = list(itertools.accumulate((lengths[i] for i in rotated), initial=0))
    cycles, rest = divmod(budget, cum[-1])
    j = bisect.bisect_right(cum, rest) - 1  # binary search: sentences fitting the rest
    order = rotated * cycles + rotated[:j]
    remainder = budget - cycles * cum[-1] - cum[j]
    for drop in range(min(len(order), 8) + 1):
        if drop:
            remainder += lengths[order.pop()]
        fill = _filler(lengths, start, remainder, tol)
        if fill is not None:
            return order + fill
    return order  # nothing fits; the caller reports the miss


def _filler(lengths: Sequence[int], start: int, remainder: int, tol: int) -> list[int] | None:
    """Fewest sentences whose token counts sum to the largest total within
    [remainder - tol, remainder] that whole sentences can make, or None. Coin change over the
    distinct lengths; each length stands for its first sentence from `start` on."""
    n = len(lengths)
    by_length: dict[int, int] = {}
    for i in ((start + k) % n for k in range(n)):
        by_length.setdefault(lengths[i], i)
    coins = sorted(c for c in by_length if 0 < c <= remainder)
    # fewest[t] = (number of sentences, last length) for a sum of exactly t, or None
    fewest: list[tuple[int, int] | None] = [(0, 0)] + [None] * remainder
    for total in range(1, remainder + 1):
        options = [(fewest[total - c][0] + 1, c) for c in coins
                   if c <= total and fewest[total - c] is not None]
        fewest[total] = min(options) if options else None
    for total in range(remainder, max(remainder - tol, 0) - 1, -1):
        if fewest[total] is not None:
            picked = []
            while total:
                picked.append(by_length[fewest[total][1]])
                total -= fewest[total][1]
            return picked
    return None


_LENGTH_CACHE: dict[tuple[int, str], tuple[Any, list[int]]] = {}


def _sentence_lengths(tokenizer: Any, haystack: str, sentences: Sequence[str]) -> list[int]:
    """Token count of each sentence with its leading space, cached per tokenizer and haystack."""
    key = (id(tokenizer), hashlib.sha256(haystack.encode("utf-8")).hexdigest())
    hit = _LENGTH_CACHE.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    ids = tokenizer([" " + s for s in sentences], add_special_tokens=False)["input_ids"]
    lengths = [len(x) for x in ids]
    if len(_LENGTH_CACHE) >= 8:
        _LENGTH_CACHE.pop(next(iter(_LENGTH_CACHE)))
    _LENGTH_CACHE[key] = (tokenizer, lengths)
    return lengths

