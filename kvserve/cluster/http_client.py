"""A small asyncio client of kvserve's OpenAI-compatible HTTP API (aiohttp), for the
benchmarks and the CLI: streamed completions as parsed chunks, and the model card.

    async with AsyncHTTPClient("http://127.0.0.1:8000") as client:
        async for chunk in client.completions("Hello", max_tokens=8, temperature=0):
            print(chunk["choices"][0]["text"], end="")

Any OpenAI client works against the same API; this one exists so that kvserve's own tools need
no SDK and can ask for vLLM's extras (`return_token_ids`, `ignore_eos`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp


class HTTPStatusError(RuntimeError):
    """A non-200 answer, or an error event inside a stream: OpenAI's error body, parsed."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {error.get('message', error)}")
        self.status = status
        self.error = error


def base_url(target: str) -> str:
    """`host:port` or `http://host:port[/]` -> `http://host:port`."""
    target = target.rstrip("/")
    return target if target.startswith(("http://", "https://")) else f"http://{target}"


class AsyncHTTPClient:
    def __init__(self, target: str, api_key: str | None = None,
                 timeout: float | None = None) -> None:
        self.url = base_url(target)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=0))  # no cap: the benchmark sets concurrency

    async def model_card(self) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/v1/models") as response:
            body = await _json_or_raise(response)
        return body["data"][0]

    async def completions(self, prompt: str | None = None, *,
                          prompt_token_ids: list[int] | None = None, **params: Any
                          ) -> AsyncIterator[dict[str, Any]]:
        """Stream /v1/completions chunks (token ids included); raises HTTPStatusError."""
        body = {"prompt": prompt if prompt is not None else prompt_token_ids, **params}
        async for chunk in self._stream("/v1/completions", body):
            yield chunk

    async def chat(self, messages: list[dict[str, str]], **params: Any
                   ) -> AsyncIterator[dict[str, Any]]:
        """Stream /v1/chat/completions chunks (token ids included)."""
        async for chunk in self._stream("/v1/chat/completions", {"messages": messages,
                                                                   **params}):
            yield chunk

    async def _stream(self, path: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        body = {"stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, **body}
        async with self.session.post(f"{self.url}{path}", json=body) as response:
            if response.status != 200:
                await _json_or_raise(response)
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise HTTPStatusError(response.status, chunk["error"])
                yield chunk

    async def close(self) -> None:
        await self.session.close()

    async def __aenter__(self) -> AsyncHTTPClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def _json_or_raise(response: aiohttp.ClientResponse) -> Any:
    body = await response.json(content_type=None)
    if response.status != 200:
        raise HTTPStatusError(response.status, (body or {}).get("error", body))
    return body
