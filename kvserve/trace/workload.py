"""What `kvserve trace` runs in-process: requests that arrive at given engine steps, so the same
workload gives the same schedule on any machine (greedy, arrivals counted in steps, not
seconds).

The built-in mixed workload shows every kind of event on a small KV pool (the "trace" entry
point's defaults: 80 MiB of device KV, 256 MiB of host tier): chats decoding together, a
~1,200-token document prefilled in 512-token chunks beside them, a repeated chat that hits the
prefix cache, and a late long prompt that runs the device pool out, so the most recently
admitted request is preempted and swapped to the host tier, then swapped back in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvserve.workers.core.outputs import RequestOutput
from kvserve.workers.engine import LLMEngine


@dataclass
class TraceRequest:
    arrive_step: int  # the engine step before which it is added
    request: dict[str, Any]  # LLMEngine.add_request's arguments
    label: str = ""  # what it stands for, in the summary
    request_id: str = field(default="", init=False)


def mixed_workload(document: str) -> list[TraceRequest]:
    """The built-in workload (see the module docstring). `document` is long prose (the
    evals' haystack); about 5,000 characters of it make the ~1,200-token document."""
    def chat(text: str, max_tokens: int) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": text}],
                "params": {"max_tokens": max_tokens, "temperature": 0.0}}

    doc = document[:5000].rsplit(" ", 1)[0]
    late = document[5000:7600].rsplit(" ", 1)[0]
    haiku = "Write a haiku about the sea."
    return [
        TraceRequest(0, chat(haiku, 40), "chat"),
        TraceRequest(0, chat("Explain in one paragraph what a KV cache is.", 64), "chat"),
        TraceRequest(2, chat(f"{doc}\n\nSummarize the passage above in one sentence.", 24),
                     "document, prefilled in chunks"),
        TraceRequest(8, chat(haiku, 16), "the first chat again: a prefix-cache hit"),
        TraceRequest(10, chat(f"{late}\n\nWhat is this passage about?", 48),
                     "long prompt: runs the KV pool out"),
        TraceRequest(12, chat("Name three colours.", 24), "chat"),
    ]


def prompt_workload(prompts: Iterable[str], max_tokens: int, arrive_every: int = 0,
                    chat: bool = False) -> list[TraceRequest]:
    """The user's prompts, greedy, the i-th arriving at step i * arrive_every."""
    out = []
    for i, text in enumerate(prompts):
        source = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        out.append(TraceRequest(i * arrive_every, {
            **source, "params": {"max_tokens": max_tokens, "temperature": 0.0}}))
    return out


def run_workload(engine: LLMEngine, requests: list[TraceRequest],
                 on_step: Callable[[int], None] | None = None,
                 on_output: Callable[[RequestOutput], None] | None = None,
                 ) -> dict[str, RequestOutput]:
    """Add each request before its step and step until all finish; returns each request's
    last output (with its timeline). `on_step(n)` after each step (a progress bar),
    `on_output` with every output."""
    pending = sorted(requests, key=lambda r: r.arrive_step)
    last: dict[str, RequestOutput] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and pending[0].arrive_step <= step:
            req = pending.pop(0)
            req.request_id = engine.add_request(**req.request)
        for out in engine.step():
            if on_output is not None:
                on_output(out)
            if out.finished:
                last[out.request_id] = out
        step += 1
        if on_step is not None:
            on_step(step)
    return last
