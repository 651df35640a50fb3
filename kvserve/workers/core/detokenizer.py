"""Incremental detokenization with stop strings, for streaming generation.

Uses the prefix_offset/read_offset scheme of vLLM and TGI: each push decodes only a short window
of recent token ids, and emits the part of its text that extends past the already-emitted
(prefix) part. Decoding a window rather than one token at a time keeps tokenizer-specific
joining right (SentencePiece leading spaces, multi-token UTF-8 characters), and keeps each push
O(1) in the length of the output.
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded as context ahead of the first generated token, as vLLM does: enough for
# the tokenizer's decoder to treat the first generated token as mid-text, not as text start.
PROMPT_CONTEXT_TOKENS = 5

# A UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens. A window that still
# ends in an incomplete character after this many unemitted tokens is invalid UTF-8 (or a literal
# U+FFFD); emit it as is rather than let the window, and the cost of each push, grow without end.
MAX_UNEMITTED_TOKENS = 16

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas safe to stream.

    `push` returns the new text (possibly ""), or None once a stop string has matched; the text
    between the last delta and the stop string is then in `stop_text`. `flush` returns what is
    still held back when generation ends for another reason (length, EOS, abort). The deltas,
    `stop_text` and `flush()` concatenate to `output_text`: the decode of the generated ids,
    cut before the earliest stop string.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: tuple[str, ...] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(s for s in stop if s)  # "" would match everywhere: ignore it
        self.output_text = ""
        self.stop_text: str | None = None  # set when a stop string matched
        self.matched_stop: str | None = None  # which stop string matched
        self.finished = False
        # The decode window: `_ids[:_read_offset]` is the prefix (already emitted, or prompt tail)
        # and the rest is unread. Older tokens are dropped: they are never decoded again.
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends mid-character: its continuation bytes would make the slicing in
            # `_decode_delta` wrong, so decode the generated tokens without context.
            self._drop_context()
        self._pending = ""  # decoded text held back as a possible stop-string start

    # -- public API ---------------------------------------------------------------------------

    def push(self, token_id: int) -> str | None:
        """Feed one generated token; return the text now safe to emit, or None on a stop."""
        if self.finished:
            raise RuntimeError("push() after the detokenizer finished (stop string or flush)")
        self._ids.append(token_id)
        self._pending += self._decode_delta(force=False)
        return self._release(final=False)

    def flush(self) -> str:
        """Finish without a stop token: return all held-back text that is not a stop string."""
        if self.finished:
            return ""
        # a character cut off by the end of generation is dropped, never emitted half-formed
        self._pending += self._decode_delta(force=True).rstrip(REPLACEMENT_CHAR)
        text = self._release(final=True)
        self.finished = True
        return self.stop_text if text is None else text

    # -- token ids -> text --------------------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        # Space clean-up rewrites text across token boundaries, so a window's decode would not
        # be a prefix of a longer window's decode; it must stay off for incremental decoding.
        return self.tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _drop_context(self) -> None:
        self._ids.clear()
        self._read_offset = 0
        self._prefix_text = ""

    def _decode_delta(self, force: bool) -> str:
        """The text the unread tokens add after the prefix window, or "" to wait for more."""
        text = self._decode(self._ids)
        bounded = len(self._ids) - self._read_offset < MAX_UNEMITTED_TOKENS
        if not force and bounded and (
            len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT_CHAR)
        ):
            # Nothing new yet (a skipped special token: keep the prefix as context), or a
            # multi-byte character is still split across tokens.
            return ""
        delta = text[len(self._prefix_text) :]
        # The tokens just read become the next prefix window.
        del self._ids[: self._read_offset]
        self._read_offset = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return delta

    # -- text -> emitted text -----------------------------------------------------------------

    def _release(self, final: bool) -> str | None:
        """Emit pending text up to a stop string, or all but a possible stop-string start."""
        match = self._find_stop(self._pending)
        if match is not None:
            start, stop = match
            self.stop_text, self.matched_stop = self._pending[:start], stop
            self.output_text += self.stop_text
            self._pending = ""
            self.finished = True
            return None
        keep = 0 if final else self._stop_prefix_len(self._pending)
        emit = self._pending[: len(self._pending) - keep]
        self._pending = self._pending[len(emit) :]
        self.output_text += emit
        return emit

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (longest on ties) as (start, stop), if any.

        Only the pending text is searched: emitted text never held a stop-string start.
        """
        best: tuple[int, str] | None = None
        for stop in self.stop:
            start = text.find(stop)
            if start < 0:
                continue
            if best is None or (start, -len(stop)) < (best[0], -len(best[1])):
                best = (start, stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
