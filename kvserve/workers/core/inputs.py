"""Validation of a request's prompt: text, token ids or chat messages -> token ids."""

from __future__ import annotations

from typing import Any

from kvserve.workers.errors import InvalidRequestError


def to_token_ids(
    tokenizer: Any,
    vocab_size: int,
    *,
    prompt: str | None = None,
    prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, str]] | None = None,
) -> list[int]:
    given = [
        name
        for name, value in (
            ("prompt", prompt),
            ("prompt_token_ids", prompt_token_ids),
            ("messages", messages),
        )
        if value is not None
    ]
    if len(given) != 1:
        raise InvalidRequestError(
            "prompt",
            f"give exactly one of prompt, prompt_token_ids, messages (got {given or 'none'})",
        )
    if prompt is not None:
        return _from_text(tokenizer, prompt)
    if messages is not None:
        return _from_messages(tokenizer, messages)
    return _checked_ids(prompt_token_ids, vocab_size)


def _from_text(tokenizer: Any, prompt: str) -> list[int]:
    if not isinstance(prompt, str):
        raise InvalidRequestError("prompt", f"must be a string, got {type(prompt).__name__}")
    if not prompt:
        raise InvalidRequestError("prompt", "must not be empty")
    return tokenizer(prompt)["input_ids"]


def _from_messages(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages", "must be a non-empty list of {role, content}")
    for i, m in enumerate(messages):
        ok = (
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            and set(m) <= {"role", "content"}
        )
        if not ok:
            raise InvalidRequestError(f"messages[{i}]", "must be {role: str, content: str}")
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(encoded["input_ids"])


def _checked_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise InvalidRequestError("prompt_token_ids", "must be a non-empty list of integers")
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InvalidRequestError("prompt_token_ids", f"item {i} is not an integer: {t!r}")
        if not 0 <= t < vocab_size:
            raise InvalidRequestError(
                "prompt_token_ids", f"item {i} = {t} is outside the vocabulary [0, {vocab_size})"
            )
    return list(ids)
