"""IncrementalDetokenizer against the real SmolLM2 tokenizer.

Expected values come from the tokenizer's own full decode and plain string operations, never
from the detokenizer itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvserve.workers.core.detokenizer import IncrementalDetokenizer

PROMPT = "<|im_start|>user\nWrite something.<|im_end|>\n<|im_start|>assistant\n"

ENGLISH = "The quick brown fox jumps over the lazy dog. It was, by all accounts, a good day."
CODE = 'def add(a, b):\n    """Sum."""\n    return a + b  # 100%\n\nprint(add(2, 3))\n'
CHINESE = "你好，世界！今天天气很好，我们去公园散步吧。"
EMOJI = "Party time 🎉😀👍🏽 and flags 🇫🇷🇯🇵 — done ✅"


@pytest.fixture(scope="session")
def tok() -> Any:
    from transformers import AutoTokenizer

    from kvserve.workers.model_executor.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(None))


@pytest.fixture(scope="session")
def prompt_ids(tok: Any) -> list[int]:
    return tok.encode(PROMPT)


@dataclass
class Stream:
    deltas: list[str] = field(default_factory=list)
    stopped_at: int | None = None  # index of the token whose push returned None
    detok: IncrementalDetokenizer | None = None

    @property
    def text(self) -> str:
        return "".join(self.deltas)


def stream(
    tok: Any,
    prompt_ids: list[int],
    ids: list[int],
    stop: tuple[str, ...] = (),
    skip_special_tokens: bool = True,
) -> Stream:
    """Push `ids` one by one like the engine does; flush at the end unless a stop matched."""
    detok = IncrementalDetokenizer(tok, prompt_ids, stop, skip_special_tokens)
    result = Stream(detok=detok)
    for i, token_id in enumerate(ids):
        delta = detok.push(token_id)
        if delta is None:
            assert detok.stop_text is not None
            result.deltas.append(detok.stop_text)
            result.stopped_at = i
            return result
        result.deltas.append(delta)
    result.deltas.append(detok.flush())
    return result


def full(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def splits_characters(tok: Any, ids: list[int]) -> bool:
    """Whether some token alone is only part of a multi-byte character."""
    return any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", [ENGLISH, CODE, CHINESE, EMOJI], ids=["en", "code", "zh", "emoji"])
def test_deltas_concatenate_to_full_decode(tok: Any, prompt_ids: list[int], text: str) -> None:
    ids = tok.encode(text)
    expected = full(tok, ids)
    assert expected == text  # the tokenizer round-trips these texts
    result = stream(tok, prompt_ids, ids)
    assert result.text == expected
    assert result.detok is not None and result.detok.output_text == expected
    assert all("\ufffd" not in delta for delta in result.deltas)


@pytest.mark.parametrize("text", [CHINESE, EMOJI], ids=["zh", "emoji"])
def test_multi_token_characters_are_held_until_complete(
    tok: Any, prompt_ids: list[int], text: str
) -> None:
    ids = tok.encode(text)
    assert splits_characters(tok, ids)  # otherwise this test would prove nothing
    detok = IncrementalDetokenizer(tok, prompt_ids)
    complete = ""  # decode of the longest token prefix that ends on a character boundary
    held = 0
    for n, token_id in enumerate(ids, start=1):
        detok.push(token_id)
        decoded = full(tok, ids[:n])
        if decoded.endswith("\ufffd"):
            held += 1
        else:
            complete = decoded
        # Text is emitted a whole token at a time, so a token holding a space and the first
        # byte of a character waits together with the rest of that character.
        assert detok.output_text == complete
    assert held > 0


def test_flush_drops_an_unfinished_character(tok: Any, prompt_ids: list[int]) -> None:
    ids = tok.encode("ok 🎉")
    cut = next(n for n in range(1, len(ids)) if full(tok, ids[:n]).endswith("\ufffd"))
    result = stream(tok, prompt_ids, ids[:cut])
    # generation ended inside the emoji: its first bytes are dropped, never emitted broken
    assert result.text == full(tok, ids[:cut]).rstrip("\ufffd") == "ok "
    assert "\ufffd" not in "".join(result.deltas)


def test_first_token_keeps_its_leading_space(tok: Any) -> None:
    prompt = tok.encode("Hello")
    ids = tok.encode(" world and more")
    assert full(tok, ids).startswith(" world")
    assert stream(tok, prompt, ids).text == full(tok, ids)


def test_prompt_ending_mid_character(tok: Any) -> None:
    ids = tok.encode("Look: 🎉🎉 yes")
    cut = next(n for n in range(1, len(ids)) if full(tok, ids[:n]).endswith("\ufffd"))
    prompt, generated = ids[:cut], ids[cut:]
    # Without the prompt, the character's remaining bytes decode as U+FFFD: still the decode
    # of the generated tokens, and no prompt text may leak into the output.
    assert stream(tok, prompt, generated).text == full(tok, generated)


def test_stop_string_spanning_two_tokens(tok: Any, prompt_ids: list[int]) -> None:
    text = "Hello world, this is a test."
    stop = "o wor"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in piece for piece in pieces)  # no single token holds the stop string
    result = stream(tok, prompt_ids, ids, stop=(stop,))
    assert result.text == text[: text.index(stop)] == "Hell"
    assert result.detok is not None and result.detok.output_text == "Hell"
    assert result.detok.matched_stop == stop
    # The push that completes the stop string is the first whose decoded text contains it.
    first = next(n for n in range(1, len(ids) + 1) if stop in full(tok, ids[:n]))
    assert result.stopped_at == first - 1
    assert all(stop not in delta for delta in result.deltas)


def test_stop_string_at_the_very_start(tok: Any, prompt_ids: list[int]) -> None:
    text = "Hello world, again."
    ids = tok.encode(text)
    result = stream(tok, prompt_ids, ids, stop=("Hello",))
    assert result.stopped_at == 0
    assert result.deltas == [""]
    assert result.detok is not None and result.detok.stop_text == ""
    assert result.detok.output_text == ""


def test_stop_string_that_is_the_whole_multi_token_prefix(tok: Any, prompt_ids: list[int]) -> None:
    text = "Hello world, again."
    ids = tok.encode(text)
    result = stream(tok, prompt_ids, ids, stop=("Hello wo",))
    assert result.text == ""
    assert result.deltas[:-1] == [""] * (len(result.deltas) - 1)  # nothing leaked before it


def test_earliest_of_several_stop_strings_wins(tok: Any, prompt_ids: list[int]) -> None:
    text = "Hello world, this is a test."
    ids = tok.encode(text)
    stops = ("world", "this", "o w")  # all present; "o w" starts first but is listed last
    expected_cut = min(text.index(s) for s in stops)
    result = stream(tok, prompt_ids, ids, stop=stops)
    assert result.text == text[:expected_cut] == "Hell"
    assert result.detok is not None and result.detok.matched_stop == "o w"


def test_partial_stop_prefix_is_released_by_a_later_push(
    tok: Any, prompt_ids: list[int]
) -> None:
    text = "We reached the EN of the road, then the END came."
    stop = "END"
    ids = tok.encode(text)
    result = stream(tok, prompt_ids, ids, stop=(stop,))
    assert result.text == text[: text.index(stop)]
    assert "EN of" in result.text  # the false start was emitted after all
    # While the decoded text ends with a stop-string prefix, that prefix is held back.
    detok = IncrementalDetokenizer(tok, prompt_ids, (stop,))
    held = 0
    for n, token_id in enumerate(ids, start=1):
        if detok.push(token_id) is None:
            break
        decoded = full(tok, ids[:n])
        if decoded.endswith("EN") or decoded.endswith("E"):
            held += 1
            assert detok.output_text == decoded[: decoded.rindex("E")]
        else:
            assert detok.output_text == decoded
    assert held >= 1


def test_partial_stop_prefix_is_released_by_flush(tok: Any, prompt_ids: list[int]) -> None:
    text = "The story ends with THE EN"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, prompt_ids, ("END", "</answer>"))
    deltas = [detok.push(i) for i in ids]
    assert None not in deltas
    assert "".join(deltas) == text[: -len("EN")]  # "EN" may still become "END"
    assert "".join(deltas) + detok.flush() == full(tok, ids) == text
    assert detok.output_text == text
    assert detok.flush() == ""  # idempotent once finished


def test_special_tokens_are_skipped(tok: Any, prompt_ids: list[int]) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    im_start = tok.convert_tokens_to_ids("<|im_start|>")
    assert im_end in tok.all_special_ids and im_start in tok.all_special_ids
    ids = tok.encode("Sure, here") + [im_end] + tok.encode(" it is.") + [im_start, im_end]
    expected = full(tok, ids)
    assert "<|im_end|>" not in expected
    result = stream(tok, prompt_ids, ids)
    assert result.text == expected == "Sure, here it is."


def test_special_tokens_kept_when_not_skipped(tok: Any, prompt_ids: list[int]) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Done") + [im_end]
    result = stream(tok, prompt_ids, ids, skip_special_tokens=False)
    assert result.text == tok.decode(ids, skip_special_tokens=False) == "Done<|im_end|>"


def test_special_token_can_complete_a_stop_string(tok: Any, prompt_ids: list[int]) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("Done") + [im_end] + tok.encode(" extra")
    result = stream(tok, prompt_ids, ids, stop=("<|im_end|>",), skip_special_tokens=False)
    assert result.text == "Done"
    assert result.stopped_at == len(tok.encode("Done"))


def test_push_after_stop_raises(tok: Any, prompt_ids: list[int]) -> None:
    ids = tok.encode("Hello world")
    detok = IncrementalDetokenizer(tok, prompt_ids, ("Hello",))
    assert detok.push(ids[0]) is None
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.push(ids[1])


class CountingTokenizer:
    """Wraps the tokenizer to record how many ids each decode call gets."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_each_push_decodes_a_bounded_window(tok: Any, prompt_ids: list[int]) -> None:
    text = (ENGLISH + " " + CHINESE + " " + EMOJI + "\n") * 40
    ids = tok.encode(text)
    assert len(ids) > 1000
    long_prompt = prompt_ids * 20  # the prompt is not decoded in full either
    counting = CountingTokenizer(tok)
    result = stream(counting, long_prompt, ids, stop=("never appears",))
    assert result.text == full(tok, ids)
    assert max(counting.sizes) <= 16
    assert len(counting.sizes) <= 2 * len(ids) + 2  # at most two decodes per push
