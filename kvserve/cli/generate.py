"""`kvserve generate`: one completion, in-process (the engine flags build its EngineConfig) or
streamed from a running deployment (--target): over gRPC for HOST:PORT, over the
OpenAI-compatible HTTP API for http://HOST:PORT."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

from kvserve.cli.engine_args import add_engine_args, engine_config
from kvserve.cli.types import words
from kvserve.workers.config import EngineConfig


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate text in-process and stream it to the terminal",
                       description="Generate a completion with the in-process engine.")
    p.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=128,
                   help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 means greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="nucleus sampling: smallest token set with this much probability "
                        "(default 1.0: off)")
    p.add_argument("--top-k", type=int, default=0,
                   help="sample from the k most likely tokens (default 0; 0 or -1: off)")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens below this fraction of the top probability (default 0: "
                        "off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed, for reproducible non-greedy output (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token_ids, finish_reason, usage)")
    c = p.add_argument_group("structured outputs (one of)").add_mutually_exclusive_group()
    c.add_argument("--json-schema", type=_text_or_file, metavar="FILE|JSON",
                   help="the output is JSON valid against this schema (a file, or the schema "
                        "itself)")
    c.add_argument("--json-object", action="store_true",
                   help="the output is a JSON object, any object")
    c.add_argument("--regex", metavar="R", help="the output matches this regular expression")
    c.add_argument("--choice", type=words, metavar="A,B,...",
                   help="the output is exactly one of these strings")
    c.add_argument("--grammar", type=_text_or_file, metavar="FILE|EBNF",
                   help="the output follows this EBNF grammar (xgrammar's dialect; a file, or "
                        "the grammar itself)")
    p.add_argument("--target", default=None, metavar="HOST:PORT|http://HOST:PORT",
                   help="stream from a running deployment instead of in-process: over gRPC "
                        "(HOST:PORT) or the OpenAI-compatible HTTP API (http://HOST:PORT)")
    p.add_argument("--api-key", default=os.environ.get("KVSERVE_API_KEY"),
                   help="the deployment's API key, with --target (default $KVSERVE_API_KEY)")
    add_engine_args(p)
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from kvserve.workers.errors import InvalidRequestError

    params: dict[str, Any] = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "stop": args.stop,
    }
    constraint = structured_outputs(args)
    if constraint is not None:
        params["structured_outputs"] = constraint
    prompt = {"messages": [{"role": "user", "content": args.prompt}]} if args.chat else {
        "prompt": args.prompt}
    if args.target and args.target.startswith(("http://", "https://")):
        return _generate_http(args.target, prompt, params, args.json, args.api_key)
    if args.target:
        return _generate_remote(args.target, prompt, params, args.json, args.api_key)
    from kvserve.workers import SamplingParams

    config = engine_config(args)
    try:  # a bad flag or a missing model fails before the engine's imports and the model load
        SamplingParams.from_dict(params).validate(vocab_size=None)
        from kvserve.workers.model_executor.loader import resolve_model_dir

        resolve_model_dir(config.model)
        result = asyncio.run(_stream(config, prompt, params, echo=not args.json))
    except InvalidRequestError as exc:
        print(f"kvserve: invalid request: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def _generate_remote(target: str, prompt: dict, params: dict, as_json: bool,
                     api_key: str | None = None) -> int:
    import grpc

    from kvserve.cluster.client import Client, finish_reason_name

    params = {k: v for k, v in params.items() if v is not None and v != []}
    text, ids, last = [], [], None
    try:
        with Client(target, api_key=api_key) as client:
            for msg in client.generate(prompt.get("prompt"), messages=prompt.get("messages"),
                                       **params):
                text.append(msg.text)
                ids += msg.token_ids
                last = msg
                if not as_json:
                    print(msg.text, end="", flush=True)
    except grpc.RpcError as exc:
        print(f"kvserve: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
    if as_json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps({
            "text": "".join(text), "token_ids": ids,
            "finish_reason": finish_reason_name(last.finish_reason) if last else None,
            "usage": MessageToDict(last.usage, preserving_proto_field_name=True) if last else None,
        }))
    else:
        print()
    return 0



def _generate_http(target: str, prompt: dict, params: dict, as_json: bool,
                   api_key: str | None) -> int:
    """The same over HTTP: /v1/completions, or /v1/chat/completions with --chat."""
    from kvserve.cluster.http_client import HTTPStatusError

    params = {k: v for k, v in params.items() if v is not None and v != []}
    try:
        result = asyncio.run(_stream_http(target, prompt, params, api_key, echo=not as_json))
    except HTTPStatusError as exc:
        print(f"kvserve: {exc}", file=sys.stderr)
        return 2 if exc.status == 400 else 1
    print(json.dumps(result) if as_json else "")
    return 0


async def _stream_http(target: str, prompt: dict, params: dict, api_key: str | None,
                       echo: bool) -> dict:
    from kvserve.cluster.http_client import AsyncHTTPClient

    text, ids, finish, usage = [], [], None, None
    async with AsyncHTTPClient(target, api_key=api_key) as client:
        chunks = client.chat(prompt["messages"], **params) if "messages" in prompt \
            else client.completions(prompt["prompt"], **params)
        async for chunk in chunks:
            if chunk.get("usage"):
                u = chunk["usage"]
                usage = {"prompt_tokens": u["prompt_tokens"],
                         "completion_tokens": u["completion_tokens"],
                         "cached_tokens": u["prompt_tokens_details"]["cached_tokens"]}
            for choice in chunk["choices"]:
                piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                text.append(piece)
                ids += choice.get("token_ids", [])
                finish = choice.get("finish_reason") or finish
                if echo:
                    print(piece, end="", flush=True)
    return {"text": "".join(text), "token_ids": ids, "finish_reason": finish, "usage": usage}


async def _stream(config: EngineConfig, prompt: dict, params: dict, echo: bool) -> dict:
    from kvserve.workers.async_engine import AsyncLLMEngine
    from kvserve.workers.engine import LLMEngine

    engine = AsyncLLMEngine(LLMEngine(config))
    text, ids, last = [], [], None
    try:
        async for out in engine.generate(**prompt, params=params):
            text.append(out.text)
            ids += out.token_ids
            last = out
            if echo:
                print(out.text, end="", flush=True)
    finally:
        await engine.shutdown()
    if echo:
        print()
    usage = vars(last.usage) if last and last.usage else None
    return {"text": "".join(text), "token_ids": ids,
            "finish_reason": last.finish_reason if last else None, "usage": usage}


def structured_outputs(args: argparse.Namespace) -> dict[str, Any] | None:
    """The --json-schema / --json-object / --regex / --choice / --grammar flag given, as the
    engine's `structured_outputs`; None when none is."""
    if args.json_schema is not None:
        try:
            return {"json": json.loads(args.json_schema)}
        except ValueError as exc:
            raise SystemExit(f"kvserve: --json-schema is not JSON: {exc}") from None
    if args.json_object:
        return {"json_object": True}
    for name in ("regex", "choice", "grammar"):
        if getattr(args, name) is not None:
            return {name: getattr(args, name)}
    return None


def _text_or_file(value: str) -> str:
    """A flag's value, or the text of the file it names."""
    path = Path(value)
    return path.read_text() if len(value) < 4096 and path.is_file() else value
