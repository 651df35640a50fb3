"""A request's input, checked and turned into a `Sequence` the scheduler can take.

Why apart from the engine: validation must leave the engine untouched (a bad request is
refused with the field it got wrong, and nothing else notices), and the front ends call it
without stepping anything (the Tokenize RPC, the HTTP API's echo, admission control sizing a
request before it is queued). As vLLM v1's input processor, it knows the tokenizer and the
limits, never the running batch.
"""

from __future__ import annotations

import secrets
import uuid
from typing import Any

import torch

from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.inputs import to_token_ids
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.rope import RotaryEmbedding
from kvserve.workers.structured_output import StructuredOutputManager


class InputProcessor:
    """Prompts to token ids, sampling params to a validated `SamplingParams`, both to a
    `Sequence` with its own seeded generator and its prefix-cache salt."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 block_manager: BlockManager, rope: RotaryEmbedding,
                 structured: StructuredOutputManager) -> None:
        self.tokenizer = tokenizer
        self.structured = structured  # compiles a constrained request's grammar
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.block_manager = block_manager  # read only: the pool's size, in blocks
        self.rope = rope

    def make_sequence(
        self,
        *,
        prompt: str | None = None,
        prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Validation only: builds the sequence without touching any engine state.

        `cache_salt` (per tenant) keeps prefix-cache hits within requests that share it."""
        params = as_params(params)
        params.validate(self.vocab_size)
        ids = self.tokenize(prompt=prompt, prompt_token_ids=prompt_token_ids, messages=messages)
        self.check_lengths(len(ids), params)
        request_id = request_id or uuid.uuid4().hex
        if not isinstance(request_id, str):
            raise InvalidRequestError("request_id", "must be a string")
        seed = params.seed if params.seed is not None else secrets.randbits(63)
        generator = torch.Generator().manual_seed(seed)
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError("cache_salt", "must be a string")
        grammar = None
        if params.structured_outputs is not None:  # last: the one check that compiles
            grammar = self.structured.matcher(params.structured_outputs)
        return Sequence(request_id, ids, params, generator, grammar=grammar,
                        cache_salt=block_salt(cache_salt or "", self.rope.cache_key(len(ids))))

    def tokenize(
        self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
    ) -> list[int]:
        """The token ids a request with this input would get (the Tokenize RPC)."""
        return to_token_ids(self.tokenizer, self.vocab_size, prompt=prompt,
                            prompt_token_ids=prompt_token_ids, messages=messages)

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (a prompt given as ids, echoed back by the HTTP API)."""
        return self.tokenizer.decode(token_ids)

    def token_texts(self, token_ids: list[int]) -> list[str]:
        """Each token's own text, as logprobs name tokens (a byte-level piece of a longer
        character decodes to U+FFFD, as in vLLM)."""
        return [self.tokenizer.decode([t]) for t in token_ids]

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """The prompt and its max_tokens fit the context and the KV pool, or the field that
        does not is named."""
        if prompt_len >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"{prompt_len} tokens leave no room in the context of {self.max_model_len} tokens",
            )
        if prompt_len + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                "max_tokens",
                f"prompt ({prompt_len}) + max_tokens ({params.max_tokens}) exceeds "
                f"the context of {self.max_model_len} tokens",
            )
        needed = self.block_manager.blocks_at_most(prompt_len + params.max_tokens)
        if needed > self.block_manager.num_blocks:
            raise InvalidRequestError(
                "max_tokens",
                f"the request needs {needed} KV blocks; the pool has "
                f"{self.block_manager.num_blocks} (raise kv_cache_memory)",
            )


def as_params(params: SamplingParams | dict[str, Any] | None) -> SamplingParams:
    """SamplingParams from what a caller passed (None: the defaults; a dict: its fields)."""
    if params is None:
        return SamplingParams()
    if isinstance(params, dict):
        return SamplingParams.from_dict(params)
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError("params", f"must be SamplingParams or a dict, not {params!r}")
    return params


def block_salt(tenant: str, rope_key: str) -> str:
    """A block hash's salt: the tenant's, and what the request's RoPE rotations depend on
    beyond its tokens (a long prompt's length under dynamic NTK, `RotaryEmbedding.cache_key`).
    The router hashes prompts with the tenant's salt alone, so such prompts route on load."""
    return f"{tenant}\0{rope_key}" if rope_key else tenant
