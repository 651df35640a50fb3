"""Sampled tokens to what a caller receives: text through each request's detokenizer, stop
strings, logprobs, usage and the final output with its timeline.

Why apart from the engine: the live request table (`requests`) belongs here, where a request's
text state lives from its arrival to its final output, and every way a request ends (a stop,
its length, an abort) goes through `final_output`, the one place that forgets it, so nothing is
kept for a request that ended. As vLLM v1's output processor, it knows the tokenizer and the
requests, never the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvserve.workers.core.detokenizer import IncrementalDetokenizer
from kvserve.workers.core.outputs import RequestOutput, TokenLogprobs, Usage
from kvserve.workers.core.sequence import FinishReason, Sequence
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.rejection_sampler import Verified
from kvserve.workers.step_recorder import StepRecorder


@dataclass
class RequestState:
    """A live request: its sequence and the detokenizer of its output so far."""

    seq: Sequence
    detok: IncrementalDetokenizer


class StepTexts:
    """The text of one step's new tokens, request by request, from each request's detokenizer
    (the scheduler pushes the tokens it keeps, in order, and stops a request on a hit)."""

    def __init__(self, requests: dict[str, RequestState]) -> None:
        self.requests = requests
        self.text: dict[str, str] = {}
        self.taken: dict[str, int] = {}  # tokens pushed (the ones the output carries)
        self.hit: set[str] = set()  # requests whose text reached a stop string

    def push(self, seq: Sequence, token: int) -> bool:
        """Append `token` to the request's text; True if its text reached a stop string."""
        rid = seq.request_id
        self.taken[rid] = self.taken.get(rid, 0) + 1
        piece = self.requests[rid].detok.push(token)
        if piece is None:
            self.hit.add(rid)
            return True
        self.text[rid] = self.text.get(rid, "") + piece
        return False


class OutputProcessor:
    """The live requests' text state and the outputs built from each step."""

    def __init__(self, tokenizer: Any, recorder: StepRecorder,
                 forget: Callable[[str], None] | None = None) -> None:
        self.tokenizer = tokenizer
        self.recorder = recorder  # an ending request's timeline
        self.forget = forget  # called with each ended request's id (the proposer's state)
        self.requests: dict[str, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.requests:
            raise InvalidRequestError("request_id", f"{seq.request_id!r} is already running")
        detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.stop)
        self.requests[seq.request_id] = RequestState(seq, detok)

    def step_texts(self) -> StepTexts:
        return StepTexts(self.requests)

    def outputs(self, seqs: list[Sequence], verified: list[Verified], texts: StepTexts,
                reasons: list[FinishReason | None]) -> list[RequestOutput]:
        """The step's output of each sequence: the tokens the scheduler kept (all new ones,
        or up to a stop); the scheduler already decided which stopped."""
        return [self._output(s, v, texts, r)
                for s, v, r in zip(seqs, verified, reasons, strict=True)]

    def _output(self, seq: Sequence, verified: Verified, texts: StepTexts,
                reason: FinishReason | None) -> RequestOutput:
        rid = seq.request_id
        n = texts.taken.get(rid, 0)
        tokens, lps = verified.token_ids[:n], verified.logprobs[:n]
        text = texts.text.get(rid, "")
        if reason is None:
            return RequestOutput(rid, tokens, text, lps)
        detok = self.requests[rid].detok
        # a stop string that matched is not part of the output
        text += detok.stop_text if rid in texts.hit else detok.flush()
        return self.final_output(seq, reason, text, lps, tokens)

    def final_output(self, seq: Sequence, reason: FinishReason, text: str,
                     logprobs: list[TokenLogprobs],
                     token_ids: list[int] | None = None) -> RequestOutput:
        """The request's last output, with its usage and timeline; the request is forgotten."""
        del self.requests[seq.request_id]
        if self.forget is not None:
            self.forget(seq.request_id)
        ttft = None
        if seq.first_token_time is not None:
            ttft = (seq.first_token_time - seq.arrival_time) * 1000
        usage = Usage(seq.num_prompt_tokens, len(seq.output_token_ids), ttft,
                      seq.num_cached_prompt_tokens, seq.num_draft_tokens, seq.num_accepted_tokens)
        return RequestOutput(seq.request_id, token_ids or [], text, logprobs, reason.value, usage,
                             self.recorder.timeline(seq))
