"""Structured outputs (kvserve/workers/structured_output.py): the request fields, the masks on
the real model, exactness against transformers with the same library's mask, batch
invariance, and the phrase recipe. Over HTTP (the openai SDK) and gRPC through Serve:
tests/test_serve_structured.py."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve.bench.structured import PROMPTS, SCHEMAS, cases
from kvserve.cluster.client import structured_outputs_message
from kvserve.cluster.convert import structured_outputs as from_message
from kvserve.cluster.openai.protocol import ChatCompletionRequest, OpenAIError
from kvserve.workers.core.sampling_params import SamplingParams, StructuredOutputs
from kvserve.workers.errors import InvalidRequestError
from tests.helpers import output_ids, schema_errors

MAX_TOKENS = 160  # every constrained answer below closes its JSON within this


def _params(**values) -> SamplingParams:
    params = SamplingParams.from_dict(values)
    params.validate(vocab_size=100)
    return params


# -- the request fields ----------------------------------------------------------------------


def test_a_constraint_is_exactly_one_kind_and_a_schema_keeps_its_key_order():
    spec = _params(structured_outputs={"json": {"b": 1, "a": 2}}).structured_outputs
    assert spec == StructuredOutputs(json='{"b":1,"a":2}') and spec.kind == "json"
    assert _params(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choice == (
        "x", "y")
    bad = [({"json": "{not json"}, "structured_outputs"),
           ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
           ({}, "structured_outputs"),
           ({"schema": {}}, "structured_outputs"),
           ({"choice": []}, "structured_outputs"),
           ({"regex": ""}, "structured_outputs")]
    for value, field in bad:
        with pytest.raises(InvalidRequestError) as err:
            _params(structured_outputs=value)
        assert err.value.field == field, value
    with pytest.raises(InvalidRequestError) as err:
        _params(structured_outputs={"json_object": True}, ignore_eos=True)
    assert err.value.field == "ignore_eos"


def test_openai_fields_become_the_engines_constraint_naming_what_the_caller_set():
    def constraint(**body):
        return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}],
                                     **body).constraint()

    schema = SCHEMAS["person"]
    assert constraint() is None
    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}) == (
        {"json_object": True}, "response_format")
    assert constraint(response_format={"type": "json_schema", "json_schema": {
        "name": "person", "schema": schema, "strict": True}}) == ({"json": schema},
                                                                  "response_format")
    assert constraint(guided_regex="[0-9]+") == ({"regex": "[0-9]+"}, "guided_regex")
    assert constraint(guided_choice=["a", "b"]) == ({"choice": ["a", "b"]}, "guided_choice")
    assert constraint(structured_outputs={"grammar": "root ::= \"x\""}) == (
        {"grammar": "root ::= \"x\""}, "structured_outputs")
    for body, param in [({"response_format": {"type": "xml"}}, "response_format"),
                        ({"response_format": {"type": "json_schema"}}, "response_format"),
                        ({"response_format": {"type": "json_object"}, "guided_regex": "a"},
                         "guided_regex")]:
        with pytest.raises(OpenAIError) as err:
            constraint(**body)
        assert err.value.param == param and err.value.status == 400


def test_the_grpc_message_carries_each_kind_both_ways():
    for spec in ({"json": SCHEMAS["tags"]}, {"json_object": True}, {"regex": "a+"},
                 {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x"'}):
        back = from_message(structured_outputs_message(spec))
        if "json" in spec:
            assert json.loads(back["json"]) == spec["json"]
        else:
            assert back == spec


# -- the real model --------------------------------------------------------------------------


def _answers(engine, constrained: bool) -> dict[tuple[str, str], str]:
    requests = []
    for name, prompt in cases():
        params = {"temperature": 0, "max_tokens": MAX_TOKENS if constrained else 32}
        if constrained:
            params["structured_outputs"] = {"json": SCHEMAS[name]}
        requests.append({"messages": [{"role": "user", "content": prompt}], "params": params,
                         "request_id": f"{name}: {prompt}"})
    outs = engine.generate_all(requests)
    return {(name, prompt): "".join(o.text for o in outs[f"{name}: {prompt}"])
            for name, prompt in cases()}


def test_thirty_prompts_on_five_schemas_all_validate_and_fail_without_the_constraint(
        real_engine):
    """100 % of 30 answers (5 schemas x 6 prompts, greedy) parse and validate with
    `jsonschema`. Negative control: the same prompts unconstrained fail validation."""
    assert len(cases()) == 30 and len(SCHEMAS) == 5
    assert schema_errors(_answers(real_engine, constrained=True)) == []
    unconstrained = schema_errors(_answers(real_engine, constrained=False))
    assert len(unconstrained) >= 25, unconstrained  # prose, mostly
    assert real_engine.structured.masked_rows > 0


def test_constrained_greedy_equals_transformers_with_the_same_mask(real_engine, hf_model):
    """transformers' `generate()` with xgrammar's own logits processor over the same compiled
    grammar writes the engine's tokens, token for token, on three schemas."""
    import torch
    from xgrammar.contrib.hf import LogitsProcessor

    for name in ("person", "review", "tags"):
        prompt = PROMPTS[name][0]
        messages = [{"role": "user", "content": prompt}]
        spec = StructuredOutputs.from_dict({"json": SCHEMAS[name]})
        ids = real_engine.tokenize(messages=messages)
        ours = output_ids(next(iter(real_engine.generate_all([{
            "prompt_token_ids": ids, "params": {"temperature": 0, "max_tokens": 40,
                                                "structured_outputs": {"json": SCHEMAS[name]}}
        }]).values())))
        processor = LogitsProcessor(real_engine.structured.compile(spec))
        with torch.no_grad():
            theirs = hf_model.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False,
                                       logits_processor=[processor], pad_token_id=2)
        assert ours == theirs[0, len(ids):].tolist(), name


def test_a_constrained_request_gets_the_same_tokens_alone_and_beside_unconstrained_ones(
        real_engine):
    """Seeded sampling at temperature 0.8: the constrained request's tokens do not depend on
    the batch (its mask is its own row's)."""
    request = {"messages": [{"role": "user", "content": PROMPTS["book"][0]}],
               "params": {"temperature": 0.8, "seed": 7, "max_tokens": 48,
                          "structured_outputs": {"json": SCHEMAS["book"]}},
               "request_id": "constrained"}
    solo = real_engine.generate_all([request])["constrained"]
    alone = output_ids(solo)
    others = [{"messages": [{"role": "user", "content": p}], "request_id": f"other-{i}",
               "params": {"temperature": 0.8, "seed": i, "max_tokens": 48}}
              for i, p in enumerate(PROMPTS["city"][:3])]
    batched = real_engine.generate_all([others[0], request, *others[1:]])
    assert output_ids(batched["constrained"]) == alone
    jsonschema.validate(json.loads("".join(o.text for o in solo)), SCHEMAS["book"])


# The phrase constraint of the design (transformers' PhrasalConstraint): a report that must
# contain given key terms. A regex of bounded free text around the phrases, in order, makes
# the engine write them within a known number of characters.
PHRASES = ("KV cache", "paged attention")
PHRASE_REGEX = r"[A-Za-z ,]{1,60}KV cache[A-Za-z ,]{1,60}paged attention[A-Za-z ,]{0,40}\."


def test_the_phrase_recipe_writes_every_required_phrase(real_engine):
    """docs/structured-outputs.md's recipe: with the regex both phrases appear. Negative
    control: unconstrained, the model's answer contains neither."""
    messages = [{"role": "user", "content": "In one sentence, why are LLM servers fast?"}]
    outs = real_engine.generate_all([
        {"messages": messages, "request_id": "recipe",
         "params": {"temperature": 0, "max_tokens": 80,
                    "structured_outputs": {"regex": PHRASE_REGEX}}},
        {"messages": messages, "request_id": "free",
         "params": {"temperature": 0, "max_tokens": 80}}])
    recipe, free = ("".join(o.text for o in outs[r]) for r in ("recipe", "free"))
    assert re.fullmatch(PHRASE_REGEX, recipe), recipe
    assert all(p in recipe for p in PHRASES)
    assert not any(p.lower() in free.lower() for p in PHRASES), free


def test_a_grammar_that_does_not_compile_is_refused_by_name_and_disturbs_nothing(real_engine):
    before = real_engine.block_manager.num_free
    for spec in ({"regex": "(unclosed"}, {"grammar": "root ::= ("},
                 {"json": {"type": "no-such-type"}}):
        with pytest.raises(InvalidRequestError) as err:
            real_engine.add_request(prompt="hi", params={"structured_outputs": spec})
        assert err.value.field == "structured_outputs", spec
    assert not real_engine.requests and real_engine.block_manager.num_free == before


class _Allows:
    """A stand-in matcher (pure logic): its grammar allows exactly `tokens` next."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def fill_next_token_bitmask(self, bitmask, row: int) -> None:
        bitmask[row] = 0
        for t in self.tokens:
            bitmask[row, t // 32] |= 1 << (t % 32)


def test_cpu_logits_are_masked_by_kvserves_kernel_where_xgrammar_would_mask(
        cpu_kernels, monkeypatch):
    """With kvserve's CPU kernels the manager masks CPU logits with `apply_token_bitmask_` and
    never calls xgrammar's apply, leaving the rows as the manager without kernels (xgrammar's
    apply) leaves them: a constrained chunk's row keeps only its allowed tokens, and the rows
    of an unconstrained chunk and its drafts stay as they were. Negative control: the same
    manager without kernels does call xgrammar's apply."""
    from types import SimpleNamespace

    import torch
    import xgrammar as xgr

    from kvserve.workers.structured_output import StructuredOutputManager

    def chunk(grammar, drafts=()):
        return SimpleNamespace(seq=SimpleNamespace(grammar=grammar), drafts=list(drafts))

    vocab = 1000
    chunks = [chunk(_Allows([5, 40, 999])), chunk(None, drafts=[1, 2]), chunk(_Allows([7]))]
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    called = []
    original = xgr.apply_token_bitmask_inplace
    monkeypatch.setattr(xgr, "apply_token_bitmask_inplace",
                        lambda *a, **k: called.append(1) or original(*a, **k))
    theirs, ours = logits.clone(), logits.clone()
    StructuredOutputManager(None, vocab, set()).apply(theirs, chunks)
    assert called == [1]
    StructuredOutputManager(None, vocab, set(), kernels=cpu_kernels).apply(ours, chunks)
    assert called == [1] and torch.equal(ours, theirs)
    assert torch.isfinite(ours[0]).sum() == 3 and torch.isfinite(ours[0, [5, 40, 999]]).all()
    assert torch.equal(ours[1:4], logits[1:4]) and torch.isfinite(ours[4]).sum() == 1


def test_a_grammar_compiles_off_the_event_loop_and_the_step_loop_and_once(make_tiny_engine,
                                                                         monkeypatch):
    """While a constrained request's grammar compiles (held here until another stream has
    received 5 more tokens), the other stream keeps getting tokens, then the constrained request
    runs and writes one of its choices; the same constraint again does not grow xgrammar's cache
    (compiled once), a new one does. Negative control, by hand: compiling in `generate` on the
    event loop instead of its executor, the hold times out with the other stream stalled."""
    import asyncio
    import threading
    import time

    from kvserve.workers.async_engine import AsyncLLMEngine
    from tests.helpers import assert_engine_idle

    core = make_tiny_engine()
    step = core.step
    monkeypatch.setattr(core, "step", lambda: time.sleep(0.005) or step())  # a long stream
    compiling, released = threading.Event(), threading.Event()
    compile_ = core.structured.compile
    cold: set[str] = set()
    held: list[bool] = []  # True: released by the other stream; False: timed out

    def slow_first_compile(spec):
        if spec.kind not in cold:  # a cold compile is slow; xgrammar's cache makes later ones fast
            cold.add(spec.kind)
            compiling.set()
            held.append(released.wait(timeout=10))
        return compile_(spec)

    monkeypatch.setattr(core.structured, "compile", slow_first_compile)
    choice = {"temperature": 0, "max_tokens": 8, "structured_outputs": {"choice": ["t7 t8", "t9"]}}

    async def scenario() -> str:
        engine = AsyncLLMEngine(core)
        plain = engine.generate(prompt_token_ids=list(range(10, 20)),
                                params={"max_tokens": 400, "ignore_eos": True})
        await anext(plain)

        async def follow() -> None:
            seen = 0
            async for _ in plain:
                seen += compiling.is_set()
                if seen >= 5:
                    released.set()
                    break  # leaving the stream aborts it

        follower = asyncio.create_task(follow())
        text = "".join([o.text async for o in engine.generate(prompt_token_ids=[10, 11],
                                                               params=choice)])
        await follower
        await engine.shutdown()
        return text

    assert asyncio.run(scenario()) in ("t7 t8", "t9")
    assert held == [True]
    assert_engine_idle(core)
    compiler = core.structured.compiler
    size = compiler.get_cache_size_bytes()
    core.compile_grammar(choice)
    assert compiler.get_cache_size_bytes() == size
    core.compile_grammar({"structured_outputs": {"choice": ["t3"]}})
    assert compiler.get_cache_size_bytes() > size


def test_a_constrained_request_is_never_given_drafts_and_its_neighbours_are(make_tiny_engine,
                                                                           monkeypatch):
    """With n-gram speculation on, the proposer is never asked for a constrained request's
    drafts (its grammar matcher cannot be rolled back), while an unconstrained request beside
    it is, and gets some; the constrained request writes one of its choices. Negative control,
    by hand: without the grammar check in `LLMEngine._propose_drafts`, the proposer is asked
    for the constrained request's drafts too."""
    engine = make_tiny_engine(speculative_method="ngram")
    asked: list[str] = []
    propose = engine.proposer.propose
    monkeypatch.setattr(engine.proposer, "propose", lambda wanted: asked.extend(
        s.request_id for s, _ in wanted) or propose(wanted))
    prompt = [10, 11, 12] * 6  # prompt lookup finds its suffix earlier in it
    out = engine.generate_all([
        {"request_id": "constrained", "prompt_token_ids": prompt,
         "params": {"temperature": 0, "max_tokens": 16,
                    "structured_outputs": {"choice": ["t7 t8 t9 t7 t8 t9", "t9"]}}},
        {"request_id": "free", "prompt_token_ids": prompt,
         "params": {"temperature": 0, "max_tokens": 16, "ignore_eos": True}}])
    assert "free" in asked and "constrained" not in asked, set(asked)
    assert engine.spec_stats.num_drafts > 0
    assert "".join(o.text for o in out["constrained"]) in ("t7 t8 t9 t7 t8 t9", "t9")


def test_a_constrained_requests_logprobs_are_those_of_the_masked_distribution(
        make_tiny_engine):
    """A constrained request's logprobs are over the tokens its grammar allows (as vLLM's): at
    each step the allowed tokens' probabilities in its top 3 sum to 1 and the rest are -inf;
    where "t7" and "t9" part, both digits are there. Negative control: unconstrained, the same
    tiny random model's top 3 hold well under 1 % of the probability."""
    import math

    engine = make_tiny_engine()

    def steps(**extra) -> list:
        params = {"temperature": 0, "max_tokens": 8, "logprobs": 3, **extra}
        out = engine.generate_all([{"prompt_token_ids": [10, 11, 12], "params": params}])
        return [lp for o in next(iter(out.values())) for lp in o.logprobs]

    constrained = steps(structured_outputs={"choice": ["t7", "t9"]})
    for lp in constrained:
        assert math.isclose(sum(math.exp(v) for _, v in lp.top), 1.0, rel_tol=1e-5), lp
    assert any(sum(v > -math.inf for _, v in lp.top) == 2 for lp in constrained)
    free = steps(ignore_eos=True)
    assert all(sum(math.exp(v) for _, v in lp.top) < 0.01 for lp in free), free


def test_max_tokens_still_ends_a_constrained_request_with_length(make_tiny_engine):
    """A JSON answer cut by `max_tokens` ends with finish_reason "length", not valid JSON; with
    room, the same request closes its object and ends with "stop"."""
    engine = make_tiny_engine()

    def answer(max_tokens: int) -> tuple[str, str]:
        params = {"temperature": 0, "max_tokens": max_tokens,
                  "structured_outputs": {"json": SCHEMAS["review"]}}
        outs = next(iter(engine.generate_all([{"prompt_token_ids": [10, 11, 12],
                                                "params": params}]).values()))
        return "".join(o.text for o in outs), outs[-1].finish_reason

    text, reason = answer(4)
    assert reason == "length"
    with pytest.raises(ValueError):
        json.loads(text)
    text, reason = answer(200)
    assert reason == "stop" and schema_errors({("review", "x"): text}) == [], text


def test_preemption_swaps_and_prefix_hits_keep_each_constraint_where_its_output_is(
        real_checkpoint, real_engine):
    """Six constrained requests in a pool that holds half of them: they are preempted, swapped
    to the host tier and back (or recomputed), and each still writes the tokens it writes
    alone, valid against its schema; run again, they start from cached prefix blocks and
    write the same. The grammar follows the output tokens, which none of these change."""
    from kvserve.workers.config import EngineConfig
    from kvserve.workers.engine import LLMEngine

    small = LLMEngine(EngineConfig(num_kv_blocks=12, num_host_kv_blocks=16, block_size=16,
                                   enable_prefix_caching=True), checkpoint=real_checkpoint)
    chosen = [(n, PROMPTS[n][i]) for n in ("person", "book", "city") for i in range(2)]
    requests = [{"messages": [{"role": "user", "content": prompt}], "request_id": prompt,
                 "params": {"temperature": 0, "max_tokens": 60,
                            "structured_outputs": {"json": SCHEMAS[name]}}}
                for name, prompt in chosen]
    pressed = small.generate_all(requests)
    assert small.scheduler.num_preemptions > 0
    alone = real_engine.generate_all(requests)
    for _, prompt in chosen:
        assert output_ids(pressed[prompt]) == output_ids(alone[prompt]), prompt
    assert schema_errors({c: "".join(o.text for o in pressed[c[1]]) for c in chosen}) == []
    again = small.generate_all([{**r, "request_id": f"again {r['request_id']}"}
                                for r in requests])
    assert sum(outs[-1].usage.cached_tokens for outs in again.values()) > 0
    for _, prompt in chosen:
        assert output_ids(again[f"again {prompt}"]) == output_ids(alone[prompt]), prompt


def test_bench_structured_reports_both_modes_at_each_batch_size(real_checkpoint, monkeypatch):
    """`kvserve bench structured` at tiny size: every request runs exactly output_len tokens
    in both modes (the long schema cannot close), and the mask's time is counted only where a
    schema is."""
    from kvserve.bench import structured
    from kvserve.cli import build_parser
    from kvserve.workers.config import EngineConfig
    from kvserve.workers.engine import LLMEngine

    monkeypatch.setattr(structured, "LLMEngine",
                        lambda config: LLMEngine(config, checkpoint=real_checkpoint))
    report = structured.run_structured_bench(EngineConfig(kv_cache_memory="256MiB"),
                                             output_len=6, repeats=1, batch_sizes=(1, 3),
                                             progress=False)
    assert [r["batch"] for r in report["rows"]] == [1, 3]
    for row in report["rows"]:
        plain, schema = row["unconstrained"], row["json_schema"]
        assert plain["output_tokens"] == schema["output_tokens"] == 6 * row["batch"]
        assert plain["masked_rows"] == 0 and schema["masked_rows"] == 6 * row["batch"]
        assert row["ratio"] == schema["tok_s"] / plain["tok_s"]
    assert "json_schema tok/s" in report["summary"] and report["weights_read_ms"] > 0
    args = build_parser().parse_args(["bench", "structured", "--batch-sizes", "1,8", "--json"])
    assert args.batch_sizes == [1, 8] and args.output_len == 64 and args.json
