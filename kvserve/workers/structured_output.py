"""Structured outputs: a request's JSON schema, regex, choice or grammar as a token mask on
every step's logits, through xgrammar.

Why xgrammar: compiling a JSON schema into a pushdown automaton over the model's tokenizer is
a compiler's work, not kvserve's; xgrammar compiles once per grammar (its own cache, bounded
here) and fills a step's bitmask in microseconds on the CPU. The mask is applied on the logits'
device: xgrammar's CUDA or Triton kernel on a GPU; on a CPU kvserve's own kernel
(`apply_token_bitmask_`, `kvserve/workers/model_executor/csrc/token_bitmask.cpp`), since
xgrammar's CPU one takes ~4.7 ms for 32 rows of SmolLM2's vocabulary, ~10 % of a decode step,
against ~0.05 ms.

Where it sits in a step:
- `compile` runs when a request is validated (`InputProcessor.make_sequence`), on the caller's
  thread (the async engine's request thread, never the step loop); a grammar that does not
  compile is refused there, naming `structured_outputs`, and nothing else is touched.
- `apply` masks the sampling rows of constrained requests before the sampler runs, greedy and
  random alike, so the sampler only ever sees allowed tokens.
- `accept` advances each matcher by the tokens the scheduler kept. Nothing else moves it:
  preemption (recompute or swap) and prefix-cache hits change where a request's KV lives, not
  its output tokens, so the matcher's state stays right through them.
- JSON is written compactly (", " and ": " between items, no other whitespace), as OpenAI's
  structured outputs are: with any whitespace allowed, a small model can write blank lines
  until its `max_tokens` instead of closing the object.
- Constrained requests do not speculate (`LLMEngine._propose_drafts`): a draft rejected would
  need the matcher rolled back, and prompt-lookup drafts rarely match a grammar's tokens.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from kvserve.workers.core.sampling_params import StructuredOutputs
from kvserve.workers.core.scheduler import ScheduledChunk
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.cpu_kernels import CpuKernels

GRAMMAR_CACHE_BYTES = 64 * 1024**2  # compiled grammars kept, least recently used out first


class StructuredOutputManager:
    """The grammar compiler for one engine's tokenizer, and the step's masks."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int],
                 cache_bytes: int = GRAMMAR_CACHE_BYTES, kernels: CpuKernels | None = None
                 ) -> None:
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.kernels = kernels  # kvserve's CPU kernels, for masking CPU logits
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_bytes = cache_bytes
        self._compiler = None  # built at the first constrained request (xgrammar's import)
        self._lock = threading.Lock()
        self.mask_seconds = 0.0  # filling and applying masks, since start (bench structured)
        self.masked_rows = 0

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=self.eos_token_ids or None)
                self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=self.cache_bytes)
            return self._compiler

    def compile(self, spec: StructuredOutputs) -> Any:
        """The compiled grammar of `spec` (from the cache when seen before); a spec that does
        not compile raises InvalidRequestError naming `structured_outputs`."""
        compiler = self.compiler
        try:
            if spec.json is not None:
                return compiler.compile_json_schema(spec.json, any_whitespace=False)
            if spec.json_object:
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                    strict_mode=False)
            if spec.regex is not None:
                return compiler.compile_regex(spec.regex)
            if spec.choice is not None:
                return compiler.compile_regex("|".join(_regex_literal(c) for c in spec.choice))
            return compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequestError("structured_outputs",
                                      f"{spec.kind}: does not compile ({_first_line(exc)})"
                                      ) from None

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher for a new request constrained by `spec`."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(self.compile(spec))

    def apply(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
        """logits: [rows, vocab], the rows of `chunks` in order (k + 1 for k drafts): mask each
        constrained chunk's row to the tokens its grammar allows next, in place."""
        rows, at = [], 0
        for c in chunks:
            if c.seq.grammar is not None:
                rows.append((at, c.seq.grammar))
            at += len(c.drafts) + 1
        if not rows:
            return
        import xgrammar as xgr

        start = time.perf_counter()
        bitmask = xgr.allocate_token_bitmask(logits.shape[0], self.vocab_size)  # [rows, words]
        for row, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, row)
        indices = [row for row, _ in rows]
        if logits.device.type == "cpu" and self.kernels is not None:
            self.kernels.apply_token_bitmask_(logits, bitmask, torch.tensor(indices),
                                              self.vocab_size)
        else:  # xgrammar's kernel on the logits' device (`to` is a no-op on the CPU)
            xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                            vocab_size=self.vocab_size, indices=indices)
        self.mask_seconds += time.perf_counter() - start
        self.masked_rows += len(rows)

    def accept(self, seqs: list[Sequence], tokens: list[list[int]], kept: dict[str, int]
               ) -> None:
        """Advance each constrained sequence's matcher by the tokens the scheduler kept
        (`kept`: request id -> how many of its `tokens`)."""
        for seq, new in zip(seqs, tokens, strict=True):
            if seq.grammar is None:
                continue
            for token in new[:kept.get(seq.request_id, 0)]:
                if not seq.grammar.is_terminated():
                    seq.grammar.accept_token(token)


def _regex_literal(text: str) -> str:
    """`text` as a regex matching exactly it."""
    return "".join("\\" + ch if ch in r"\.^$|?*+()[]{}/" else ch for ch in text)


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1][:300] if lines else type(exc).__name__
