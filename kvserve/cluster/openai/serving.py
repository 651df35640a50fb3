"""OpenAI's completions and chat completions over one AsyncLLMEngine: request bodies in,
response bodies (or server-sent-event lines) out. No web framework here:
`kvserve.cluster.openai.http`
mounts it on FastAPI, and a test can call it directly.

Why each choice:
- The prompt is tokenized once, here, and the engine gets token ids: the chat template (the
  model's own, applied by the engine's tokenizer) and the default `max_tokens` both need the
  prompt's length, and the engine then does not tokenize it again.
- A stream's first output is awaited before the response starts, so every error the engine
  raises when it takes a request (bad parameter, queue full, shutting down) is answered with
  its own HTTP status, never as a 200 whose stream carries an error. Errors after that (the
  replica died under the stream) are sent as an SSE `error` event, as vLLM does.
- `n` > 1 runs n engine requests with the same prompt (sample j seeded `seed + j`); sample 0
  first, so that the others start from its cached prompt blocks.
- Leaving a stream early (the client went away, Serve cancelled the handler) closes every
  engine stream, which aborts its request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.cluster.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    OpenAIError,
    SamplingFields,
    TokenizeRequest,
    new_id,
    now,
)
from kvserve.cluster.tracing import RequestTracer, traced
from kvserve.workers.async_engine import AsyncLLMEngine, Observer, unobserved
from kvserve.workers.core.outputs import RequestOutput, TokenLogprobs
from kvserve.workers.errors import EngineShutdownError, InvalidRequestError, QueueFullError

RETRY_AFTER_S = 1  # what a 429 tells the client to wait: the queue drains within steps
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
             "presence_penalty", "frequency_penalty", "speculate")


def openai_error(exc: BaseException, rename: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI-shaped answer to an error the engine raised; `rename` maps engine field
    names to this endpoint's parameter names (chat's `prompt` is `messages`)."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        param = (rename or {}).get(exc.field, exc.field)
        return OpenAIError(400, f"{param}: {exc.message}", param=param)
    if isinstance(exc, QueueFullError):
        return OpenAIError(429, str(exc), "rate_limit_error", param=exc.setting,
                           code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineShutdownError):
        return OpenAIError(503, str(exc), "service_unavailable_error")
    return OpenAIError(500, f"{type(exc).__name__}: {exc}", "internal_error")


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


@dataclass
class _Sample:
    """One choice: its prompt, its engine stream, and what it produced so far."""

    index: int
    prompt_ids: list[int]
    stream: AsyncIterator[RequestOutput]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Any = None
    first: RequestOutput | None = None  # its first output, awaited before the response


    def add(self, out: RequestOutput) -> None:
        self.text += out.text
        self.token_ids += out.token_ids
        self.logprobs += out.logprobs
        if out.finished:
            self.finish_reason, self.usage = out.finish_reason, out.usage


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model_name: str | None = None,
                 observe: Observer | None = None, replicas: int = 1,
                 on_usage: Callable[[str, int], None] | None = None,
                 tracer: RequestTracer | None = None) -> None:
        """`observe` wraps each engine output stream (the replica's metrics), as gRPC's;
        `replicas`: the deployment's, as /v1/models reports it; `on_usage(tenant, tokens)`:
        told the prompt + completion tokens of each request a tenant made (its limits);
        `tracer`: each request's OpenTelemetry spans, under the caller's `traceparent`."""
        self.engine = engine
        self.replicas = replicas
        self.on_usage = on_usage
        self.model = served_model_name or engine.info.name
        self.observe = observe or unobserved
        self.tracer = tracer

    # -- small endpoints ---------------------------------------------------------------------
    def models(self) -> dict[str, Any]:
        info = self.engine.info
        card = ModelCard(id=self.model, root=self.model, max_model_len=info.max_model_len,
                         vocab_size=info.vocab_size, replicas=self.replicas)
        return {"object": "list", "data": [card.model_dump()]}

    def health(self) -> None:
        """Raises (answered 503) once the engine cannot serve."""
        try:
            self.engine.check_health()
        except Exception as exc:  # noqa: BLE001 - any failure means not ready
            raise OpenAIError(503, f"not ready: {exc}", "service_unavailable_error") from exc

    def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise OpenAIError(400, "give exactly one of prompt, messages", param="prompt")
        try:
            if req.messages is not None:
                chat = ChatCompletionRequest(messages=req.messages)
                ids = self.engine.tokenize(messages=chat.chat_messages())
            else:
                ids = self.engine.tokenize(prompt=req.prompt)
        except InvalidRequestError as exc:
            raise openai_error(exc) from exc
        return {"count": len(ids), "max_model_len": self.engine.info.max_model_len,
                "tokens": ids}

    def check_model(self, name: str | None) -> None:
        if name not in (None, "", self.model):
            raise OpenAIError(404, f"The model `{name}` does not exist (this service serves "
                              f"`{self.model}`).", param="model", code="model_not_found")

    # -- completions -------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, tenant: str | None = None,
                          trace: Mapping[str, str] | None = None,
                          ) -> dict[str, Any] | AsyncIterator[str]:
        """`tenant`: the caller's (API key), its default prefix-cache salt; `trace`: the
        caller's W3C trace context (its `traceparent` header)."""
        rename = {"prompt_token_ids": "prompt"}
        self._check(req)
        prompts = req.prompts()
        try:
            ids = [self.engine.tokenize(prompt=p) if isinstance(p, str)
                   else self.engine.tokenize(prompt_token_ids=p) for p in prompts]
        except InvalidRequestError as exc:
            raise openai_error(exc, rename) from exc
        max_tokens = req.max_tokens if req.max_tokens is not None else 16  # OpenAI's default
        samples = await self._start(req, ids, lambda _: max_tokens, req.logprobs, rename,
                                    tenant, trace)
        head = {"id": new_id("cmpl"), "object": "text_completion", "created": now(),
                "model": self.model}
        echoes = [self.engine.detokenize(i) if req.echo else "" for i in ids]
        if req.stream:
            return self._stream(samples, head, req.n, req.include_usage(),
                                lambda s, out, first: self._completion_delta(
                                    s, out, echoes[s.index // req.n] if first else "", req),
                                tenant)
        await self._drain(samples, tenant)
        choices = [{"index": s.index, "text": echoes[s.index // req.n] + s.text,
                    "logprobs": self._completion_logprobs(s.logprobs, req),
                    "finish_reason": s.finish_reason} | _ids(req, s.token_ids)
                   for s in samples]
        return {**head, "choices": choices, "usage": _usage(samples, req.n)}

    def _completion_delta(self, s: _Sample, out: RequestOutput, echo: str,
                          req: CompletionRequest) -> dict[str, Any]:
        return {"index": s.index, "text": echo + out.text,
                "logprobs": self._completion_logprobs(out.logprobs, req),
                "finish_reason": out.finish_reason} | _ids(req, out.token_ids)

    def _completion_logprobs(self, lps: list[TokenLogprobs], req: CompletionRequest
                             ) -> dict[str, Any] | None:
        if req.logprobs is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        texts = self.engine.token_texts([lp.token_id for lp in lps])
        tokens = [f"token_id:{lp.token_id}" for lp in lps] if as_ids else texts
        offsets, at = [], 0
        for t in texts:
            offsets.append(at)
            at += len(t)
        tops = []
        for lp in lps:
            names = [f"token_id:{t}" for t, _ in lp.top] if as_ids \
                else self.engine.token_texts([t for t, _ in lp.top])
            tops.append(dict(zip(names, (v for _, v in lp.top), strict=True)))
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": tops, "text_offset": offsets}

    # -- chat completions --------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest, tenant: str | None = None,
                   trace: Mapping[str, str] | None = None,
                   ) -> dict[str, Any] | AsyncIterator[str]:
        limit_name = "max_completion_tokens" if req.max_completion_tokens is not None \
            else "max_tokens"
        rename = {"prompt": "messages", "prompt_token_ids": "messages",
                  "logprobs": "top_logprobs", "max_tokens": limit_name}
        self._check(req)
        try:
            ids = self.engine.tokenize(messages=req.chat_messages())
        except InvalidRequestError as exc:
            raise openai_error(exc, rename) from exc
        asked = req.max_completion_tokens if req.max_completion_tokens is not None \
            else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        samples = await self._start(
            req, [ids], lambda n: asked if asked is not None else self._room(n), logprobs,
            rename, tenant, trace)
        head = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": now(),
                "model": self.model}
        if req.stream:
            chunk_head = {**head, "object": "chat.completion.chunk"}
            return self._stream(samples, chunk_head, req.n, req.include_usage(),
                                lambda s, out, first: self._chat_delta(s, out, first, req),
                                tenant)
        await self._drain(samples, tenant)
        choices = [{"index": s.index,
                    "message": {"role": "assistant", "content": s.text},
                    "logprobs": self._chat_logprobs(s.logprobs, req) if req.logprobs
                    else None,
                    "finish_reason": s.finish_reason} | _ids(req, s.token_ids)
                   for s in samples]
        return {**head, "choices": choices, "usage": _usage(samples, req.n)}

    def _chat_delta(self, s: _Sample, out: RequestOutput, first: bool,
                    req: ChatCompletionRequest) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": out.text} if first \
            else {"content": out.text}
        if out.finished and not out.text and not first:
            delta = {}
        return {"index": s.index, "delta": delta,
                "logprobs": self._chat_logprobs(out.logprobs, req) if req.logprobs else None,
                "finish_reason": out.finish_reason} | _ids(req, out.token_ids)

    def _chat_logprobs(self, lps: list[TokenLogprobs], req: ChatCompletionRequest
                       ) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.engine.token_texts([token_id])[0]
            name = f"token_id:{token_id}" if req.return_tokens_as_token_ids else text
            return {"token": name, "logprob": logprob, "bytes": list(text.encode())}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps]}

    def _room(self, prompt_len: int) -> int:
        """Chat's default `max_tokens`: what is left of the context (vLLM's default), and of
        the KV pool, so a request without a limit is never refused for its size alone."""
        info = self.engine.info
        return max(1, min(info.max_model_len, info.block_size * info.num_blocks) - prompt_len)

    # -- shared ------------------------------------------------------------------------------
    def _check(self, req: SamplingFields) -> None:
        self.check_model(req.model)
        refused = req.refused()
        if refused is not None:
            raise OpenAIError(400, f"{refused[0]}: {refused[1]}", param=refused[0])

    async def _start(self, req: SamplingFields, prompts: list[list[int]],
                     max_tokens: Callable[[int], int], logprobs: int | None,
                     rename: dict[str, str], tenant: str | None,
                     trace: Mapping[str, str] | None = None) -> list[_Sample]:
        """Open n streams per prompt and await each one's first output (see the module's
        docstring); on any error close the ones opened, then raise it OpenAI-shaped.

        Sample 0 of each prompt goes first: once it has its first token its prompt blocks are
        cached, and samples 1..n-1, opened then, start from them (with prefix caching on)
        instead of computing the same prompt n times in one step."""
        request_id = new_id("req")
        salt = req.cache_salt or tenant
        constraint = req.constraint()
        if constraint is not None:  # the engine's errors name the parameter the caller set
            rename = {**rename, "structured_outputs": constraint[1]}

        def open_sample(p: int, ids: list[int], j: int) -> _Sample:
            params = _engine_params(req, max_tokens(len(ids)), logprobs, j, constraint)
            index = p * req.n + j
            stream = traced(self.observe(self.engine.generate(
                prompt_token_ids=ids, params=params, cache_salt=salt,
                request_id=f"{request_id}-{index}")), self.tracer, trace)
            return _Sample(index, ids, stream)

        samples: list[_Sample] = []
        try:
            for wave in (range(1), range(1, req.n)):
                opened = [open_sample(p, ids, j) for p, ids in enumerate(prompts) for j in wave]
                samples += opened
                await _first_outputs(opened)
        except BaseException as exc:
            await _close(samples)
            if isinstance(exc, Exception):
                raise openai_error(exc, rename) from exc
            raise
        samples.sort(key=lambda s: s.index)
        return samples

    def _stream(self, samples: list[_Sample], head: dict[str, Any], n: int,
                include_usage: bool, delta: Callable[..., dict[str, Any]],
                tenant: str | None) -> AsyncIterator[str]:
        async def events() -> AsyncIterator[str]:
            try:
                for s in samples:  # the outputs awaited before the response began
                    assert s.first is not None
                    yield sse(_chunk(head, delta(s, s.first, True), include_usage))
                async for s, out in _merged(samples):
                    s.add(out)
                    yield sse(_chunk(head, delta(s, out, False), include_usage))
                if include_usage:
                    yield sse({**head, "choices": [], "usage": _usage(samples, n)})
            except Exception as exc:  # noqa: BLE001 - the status is sent: say it in the stream
                yield sse(openai_error(exc).body())
            finally:
                await _close(samples)
                self._used(samples, tenant)
            yield sse("[DONE]")

        return events()


    async def _drain(self, samples: list[_Sample], tenant: str | None) -> None:
        try:
            async for s, out in _merged(samples):
                s.add(out)
        finally:
            await _close(samples)
            self._used(samples, tenant)

    def _used(self, samples: list[_Sample], tenant: str | None) -> None:
        """Tell `on_usage` what the request computed: every sample's prompt and tokens."""
        if tenant is not None and self.on_usage is not None:
            self.on_usage(tenant, sum(len(s.prompt_ids) + len(s.token_ids) for s in samples))


def _ids(req: SamplingFields, token_ids: list[int]) -> dict[str, Any]:
    """vLLM's `return_token_ids`: the choice's (or the delta's) token ids."""
    return {"token_ids": list(token_ids)} if req.return_token_ids else {}


def _chunk(head: dict[str, Any], choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
    chunk = {**head, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None  # OpenAI's: every chunk but the last has a null usage
    return chunk


def _engine_params(req: SamplingFields, max_tokens: int, logprobs: int | None, j: int,
                   constraint: tuple[dict[str, Any], str] | None = None) -> dict[str, Any]:
    """Sample j's engine params; `constraint`: `req.constraint()`, worked out once."""
    values: dict[str, Any] = {"max_tokens": max_tokens}
    values |= {name: v for name in _SAMPLING if (v := getattr(req, name)) is not None}
    if req.seed is not None:
        values["seed"] = req.seed + j  # sample j of n: its own stream of random numbers
    if req.stop:
        values["stop"] = [req.stop] if isinstance(req.stop, str) else list(req.stop)
    if req.stop_token_ids:
        values["stop_token_ids"] = list(req.stop_token_ids)
    if req.ignore_eos:
        values["ignore_eos"] = True
    if logprobs is not None:
        values["logprobs"] = logprobs
    if constraint is not None:
        values["structured_outputs"] = constraint[0]
    return values


def _usage(samples: list[_Sample], n: int) -> dict[str, Any]:
    """OpenAI's usage: each prompt counted once (its first sample's), every sample's
    completion tokens; cached tokens are the prompt tokens served from the prefix cache."""
    firsts = [s for s in samples if s.index % n == 0]
    prompt = sum(len(s.prompt_ids) for s in firsts)
    completion = sum(len(s.token_ids) for s in samples)
    cached = sum(s.usage.cached_tokens for s in firsts if s.usage is not None)
    usages = [s.usage for s in samples if s.usage is not None]
    drafts = sum(u.draft_tokens for u in usages)
    accepted = sum(u.accepted_draft_tokens for u in usages)
    # speculative decoding's drafts in OpenAI's Predicted Outputs fields: tokens proposed
    # ahead and verified by the model, accepted or rejected
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": drafts - accepted}}


async def _first_outputs(samples: list[_Sample]) -> None:
    """Await every sample's first output; on an error stop the others' waits (a generator must
    stop running before it can be closed) and raise it."""
    firsts: list[asyncio.Future] = [asyncio.ensure_future(anext(s.stream)) for s in samples]
    try:
        for s, out in zip(samples, await asyncio.gather(*firsts), strict=True):
            s.add(out)
            s.first = out
    except BaseException:
        for f in firsts:
            f.cancel()
        await asyncio.gather(*firsts, return_exceptions=True)
        raise


async def _merged(samples: list[_Sample]) -> AsyncIterator[tuple[_Sample, RequestOutput]]:
    """Every unfinished sample's outputs, as they come."""
    live = [s for s in samples if s.finish_reason is None]
    if len(live) == 1:
        async for out in live[0].stream:
            yield live[0], out
        return
    queue: asyncio.Queue[tuple[_Sample, RequestOutput] | BaseException | None] = \
        asyncio.Queue()

    async def pump(s: _Sample) -> None:
        try:
            async for out in s.stream:
                queue.put_nowait((s, out))
            queue.put_nowait(None)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(exc)

    tasks = [asyncio.create_task(pump(s)) for s in live]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close(samples: list[_Sample]) -> None:
    """Close every engine stream: an unfinished one aborts its request, freeing its blocks."""
    for s in samples:
        await s.stream.aclose()  # type: ignore[attr-defined]
