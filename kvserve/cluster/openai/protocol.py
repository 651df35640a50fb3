"""The OpenAI request bodies kvserve accepts, and its errors in OpenAI's shape.

Field names, types and defaults are OpenAI's (plus vLLM's extras: top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids, cache_salt, structured_outputs and the
guided_json / guided_regex / guided_choice / guided_grammar it replaces; and kvserve's
`speculate`), so the `openai` SDK, LangChain and lm-evaluation-harness send what they always
send. `response_format` json_object and json_schema become the engine's structured outputs.
Unknown fields are ignored, as vLLM does; fields kvserve cannot honour (`suffix`, `logit_bias`,
`tools`, `best_of` other than `n`) are refused naming the field rather than silently dropped.

Range checks are the engine's own (`SamplingParams.validate`): this module only checks types,
so one definition of every bound serves gRPC, HTTP and in-process callers alike.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}` with `status`."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code = code if code is not None else status
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What completions and chat completions share: OpenAI's sampling fields, vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    cache_salt: str | None = None
    # kvserve's: false opts the request out of the deployment's speculative decoding
    speculate: bool | None = None
    # logprobs name tokens "token_id:N" (exact, where text pieces can be ambiguous)
    return_tokens_as_token_ids: bool = False
    # each choice (and each streamed delta) carries its new `token_ids`
    return_token_ids: bool = False
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs / guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def refused(self) -> tuple[str, str] | None:
        """(field, why) for a field set to something kvserve cannot honour."""
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.n < 1:
            return "n", f"must be >= 1, got {self.n}"
        try:
            self.constraint()
        except OpenAIError as exc:
            return exc.param or "response_format", exc.message
        return None

    def constraint(self) -> tuple[dict[str, Any], str] | None:
        """The output constraint the request sets, as the engine's `structured_outputs`
        (`SamplingParams`), and the parameter that set it, which its errors name; None if
        none. At most one of response_format, structured_outputs and guided_* may be set."""
        given: list[tuple[dict[str, Any], str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.get("type", "text") != "text":
            if fmt.get("type") == "json_object":
                given.append(({"json_object": True}, "response_format"))
            elif fmt.get("type") == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise OpenAIError(400, "response_format: json_schema needs a `schema` "
                                      "object", param="response_format")
                given.append(({"json": schema}, "response_format"))
            else:
                raise OpenAIError(400, "response_format: type must be text, json_object or "
                                  f"json_schema, not {fmt.get('type')!r}",
                                  param="response_format")
        if self.structured_outputs is not None:
            given.append((dict(self.structured_outputs), "structured_outputs"))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            if (value := getattr(self, name)) is not None:
                given.append(({key: value}, name))
        if len(given) > 1:
            raise OpenAIError(400, f"{given[1][1]}: set one of response_format, "
                              "structured_outputs and guided_*, not several",
                              param=given[1][1])
        return given[0] if given else None

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of must equal n (kvserve returns every sample)"
        if self.echo and self.logprobs is not None:
            return "echo", "echo with logprobs would need prompt logprobs, which are not computed"
        if not self.prompts():
            return "prompt", "must not be empty"
        return super().refused()

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of a batch: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    def refused(self) -> tuple[str, str] | None:
        if self.tools:
            return "tools", "tool calling is not supported"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs: true"
        return super().refused()

    def chat_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them: text content only."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise OpenAIError(400, f"messages[{i}].content: only text parts are "
                                      "supported", param="messages")
                content = "".join(str(part.get("text", "")) for part in content)
            out.append({"role": m.role, "content": content or ""})
        return out


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages (with the model's template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


FinishReason = Literal["stop", "length", "abort"]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "kvserve"
    root: str | None = None
    max_model_len: int | None = None
    # kvserve's extras, what the gRPC ModelInfo says: benchmarks draw random prompts from it
    vocab_size: int | None = None
    replicas: int | None = None
