"""The asyncio engine: streaming, incremental text, abort and cancellation free every block."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.workers.async_engine import AsyncLLMEngine
from tests.helpers import assert_engine_idle


def test_streamed_chinese_and_emoji_text_is_never_broken(real_engine):
    async def scenario() -> None:
        engine = AsyncLLMEngine(real_engine)
        for prompt in ("请用中文介绍一下北京的历史。", "Reply with five emojis about space: 🚀"):
            outs = [o async for o in engine.generate(
                messages=[{"role": "user", "content": prompt}],
                params={"max_tokens": 48, "temperature": 0})]
            ids = [t for o in outs for t in o.token_ids]
            assert all("\ufffd" not in o.text for o in outs)
            # a character cut off by max_tokens is dropped, never emitted half-formed
            expected = real_engine.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")
            assert "".join(o.text for o in outs) == expected
            assert len(outs) == len(ids)  # one output per token: streamed, not batched at the end
            assert sum(1 for o in outs if o.text) > 5
            assert outs[-1].usage.completion_tokens == len(ids)
            assert outs[-1].usage.time_to_first_token_ms > 0
        await engine.shutdown()

    asyncio.run(scenario())
    assert_engine_idle(real_engine)


def test_stop_string_is_cut_from_the_output(real_engine):
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    full = real_engine.generate_all([{"messages": prompt, "params": {"max_tokens": 20,
                                                                     "temperature": 0}}])
    text = "".join(o.text for o in next(iter(full.values())))
    assert "Paris" in text
    cut = real_engine.generate_all([{"messages": prompt, "params": {
        "max_tokens": 20, "temperature": 0, "stop": ["Paris"]}}])
    outs = next(iter(cut.values()))
    assert "".join(o.text for o in outs) == text[: text.index("Paris")]
    assert outs[-1].finish_reason == "stop"


def test_abort_frees_all_blocks_at_once(make_tiny_engine):
    core = make_tiny_engine()

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        stream = engine.generate(prompt_token_ids=list(range(10, 90)),
                                 params={"max_tokens": 200, "ignore_eos": True})
        outs = [await anext(stream) for _ in range(3)]
        assert core.block_manager.num_free < core.block_manager.num_blocks
        engine.abort(outs[0].request_id)
        rest = [out async for out in stream]  # outputs already queued, then the abort
        assert rest[-1].finish_reason == "abort"
        assert len(outs) + len(rest) < 200
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_cancelling_or_leaving_the_stream_aborts_the_request(make_tiny_engine):
    core = make_tiny_engine()

    async def consume(engine: AsyncLLMEngine, seen: list) -> None:
        async for out in engine.generate(prompt_token_ids=list(range(10, 50)),
                                          params={"max_tokens": 400, "ignore_eos": True}):
            seen.append(out)

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        seen: list = []
        task = asyncio.create_task(consume(engine, seen))
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for _ in range(100):  # freed before the next step, i.e. within one step
            if not core.requests:
                break
            await asyncio.sleep(0.01)
        assert_engine_idle(core)
        async for _ in engine.generate(prompt_token_ids=[5, 6, 7], params={"max_tokens": 50,
                                                                           "ignore_eos": True}):
            break  # leaving early aborts too
        await asyncio.sleep(0.2)
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_full_admission_queue_rejects_new_requests_and_leaves_the_others_alone(
    make_tiny_engine,
):
    from kvserve.workers.errors import QueueFullError

    core = make_tiny_engine(max_num_seqs=1, max_waiting_requests=2)
    params = {"max_tokens": 8, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        streams = [engine.generate(prompt_token_ids=[10 + i, 11, 12], params=params)
                   for i in range(3)]
        firsts = [await anext(streams[0])]  # one running (max_num_seqs=1) ...
        firsts += [asyncio.create_task(anext(s)) for s in streams[1:]]  # ... and two waiting
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="max_waiting_requests=2") as err:
            await anext(engine.generate(prompt_token_ids=[5, 6], params=params))
        assert (err.value.waiting, err.value.limit) == (2, 2)
        await asyncio.gather(*firsts[1:])
        rest = [[o async for o in s] for s in streams]
        assert all(r[-1].finish_reason == "length" for r in rest)
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_shutdown_ends_open_streams_with_an_error_and_refuses_new_requests(make_tiny_engine):
    from kvserve.workers.errors import EngineShutdownError

    core = make_tiny_engine(max_num_seqs=1)
    params = {"max_tokens": 500, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        running = engine.generate(prompt_token_ids=[10, 11, 12], params=params)
        waiting = engine.generate(prompt_token_ids=[20, 21], params=params)
        await anext(running)
        waiting_first = asyncio.create_task(anext(waiting))
        await asyncio.sleep(0)
        await engine.shutdown()
        for stream_next in (anext(running), waiting_first):
            with pytest.raises(EngineShutdownError):
                while True:  # outputs produced before shutdown may come first
                    await stream_next
                    stream_next = anext(running)
        with pytest.raises(EngineShutdownError):
            await anext(engine.generate(prompt_token_ids=[1, 2], params=params))
        assert_engine_idle(core)
        await engine.shutdown()  # idempotent

    asyncio.run(scenario())


def test_admission_is_bounded_by_the_kv_the_waiting_requests_need(make_tiny_engine):
    from kvserve.workers.errors import QueueFullError

    # 16 blocks of 4 tokens; each request needs 6 (3 + 20 tokens): the limit, one pool's worth,
    # holds two waiting requests but not a third
    core = make_tiny_engine(num_kv_blocks=16, block_size=4, max_num_seqs=1,
                            max_waiting_requests=8, max_waiting_kv_pools=1.0)
    params = {"max_tokens": 20, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        streams = [engine.generate(prompt_token_ids=[10 + i, 11, 12], params=params)
                   for i in range(3)]
        firsts = [await anext(streams[0])]
        firsts += [asyncio.create_task(anext(s)) for s in streams[1:]]
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match="max_waiting_kv_pools=1 x 16 blocks") as err:
            await anext(engine.generate(prompt_token_ids=[5, 6, 7], params=params))
        assert (err.value.waiting, err.value.limit) == (18, 16)
        short = engine.generate(prompt_token_ids=[5], params={"max_tokens": 3})  # 1 block fits
        await asyncio.gather(*firsts[1:])
        rest = [[o async for o in s] for s in [*streams, short]]
        assert all(r[-1].finish_reason == "length" for r in rest)
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def _engine_at_100_prompt_tokens_per_s(make_tiny_engine):
    """A 16-token step budget, a 1 s time bound, and a rate as if measured at 100 prompt
    tokens/s (smoothing 0 keeps it while the tiny model runs)."""
    from kvserve.workers.core.prefill_rate import PrefillRate

    core = make_tiny_engine(max_num_batched_tokens=16, max_expected_wait_s=1.0)
    core.prefill_rate = PrefillRate(budget=16, smoothing=0.0, tokens_per_s=100.0)
    return core


def test_admission_is_bounded_by_the_expected_wait_for_the_prompts_ahead(make_tiny_engine):
    from kvserve.workers.errors import QueueFullError

    core = _engine_at_100_prompt_tokens_per_s(make_tiny_engine)
    long_prompt = [10 + i % 50 for i in range(300)]  # 19 steps of 16 tokens: 3 s at 100 tok/s
    params = {"max_tokens": 4, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        first = engine.generate(prompt_token_ids=long_prompt, params=params)  # idle: admitted
        first_out = asyncio.create_task(anext(first))
        await asyncio.sleep(0)
        with pytest.raises(QueueFullError, match=r"prompt work .* \(max_expected_wait_s=1\)"):
            await anext(engine.generate(prompt_token_ids=[5, 6, 7], params=params))
        await first_out
        rest = [o async for o in first]
        assert rest[-1].finish_reason == "length"
        after = [o async for o in engine.generate(prompt_token_ids=[5, 6, 7], params=params)]
        assert after[-1].finish_reason == "length"  # nothing ahead any more
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_the_time_bound_counts_the_requests_own_prompt_once_the_replica_is_busy(make_tiny_engine):
    from kvserve.workers.errors import QueueFullError

    core = _engine_at_100_prompt_tokens_per_s(make_tiny_engine)
    params = {"max_tokens": 30, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        decoding = engine.generate(prompt_token_ids=[5, 6, 7], params=params)
        await anext(decoding)  # it decodes: no prompt work is left ahead of a new request
        # its own 150 tokens at 100 tok/s x 15/16 of each step: 1.6 s to its first token
        with pytest.raises(QueueFullError, match=r"150 tokens"):
            await anext(engine.generate(prompt_token_ids=list(range(10, 160)), params=params))
        short = [o async for o in engine.generate(prompt_token_ids=list(range(10, 60)),
                                                  params=params)]  # 0.53 s: admitted
        assert short[-1].finish_reason == "length"
        assert [o async for o in decoding][-1].finish_reason == "length"
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_prefill_rate_learns_from_full_steps_and_shares_the_budget_with_decodes():
    from kvserve.workers.core.prefill_rate import PrefillRate

    rate = PrefillRate(budget=512, smoothing=0.5)
    assert rate.seconds_for(1000) is None  # nothing measured: no time bound yet
    rate.observe(tokens=8, seconds=0.1)  # a decode step says nothing about prompt throughput
    assert rate.tokens_per_s is None
    rate.observe(tokens=512, seconds=1.0)
    rate.observe(tokens=400, seconds=0.5)
    assert rate.tokens_per_s == pytest.approx(656)  # 512 + 0.5 * (800 - 512)
    assert rate.seconds_for(656) == pytest.approx(1.0)
    assert rate.seconds_for(656, decoding=256) == pytest.approx(2.0)  # half the budget decodes
    # under a 200 ms latency target, 32 decodes get a 131-token step (656 tok/s x 0.2 s): prompts
    # have 99 of its tokens, not the 480 of a full step
    assert rate.seconds_for(656, decoding=32, step_ms=200.0) == pytest.approx(656 * 131 / 99 / 656)
    assert rate.seconds_for(656, decoding=32) == pytest.approx(512 / 480)


def test_while_a_request_decodes_prompt_chunks_fit_the_itl_target(make_tiny_engine):
    from kvserve.workers.core.prefill_rate import PrefillRate
    from kvserve.workers.core.sampling_params import SamplingParams

    engine = make_tiny_engine(itl_target_ms=200.0)  # 512-token budget by default
    engine.prefill_rate = PrefillRate(budget=512, smoothing=0.0, tokens_per_s=100.0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    engine.add_request(prompt_token_ids=[5, 6, 7], params=params, request_id="decoding")
    engine.step()  # its whole prompt: nothing was decoding, so the full budget
    engine.add_request(prompt_token_ids=list(range(10, 310)), params=params, request_id="long")
    long_seq = engine.requests["long"].seq
    for _ in range(3):
        before = long_seq.num_computed_tokens
        outs = {o.request_id for o in engine.step()}
        assert "decoding" in outs  # a token every step
        assert long_seq.num_computed_tokens - before == 19  # 100 tok/s x 0.2 s, less 1 decode
    while engine.has_unfinished():
        engine.step()
    assert_engine_idle(engine)
    assert PrefillRate(budget=512, tokens_per_s=1e5).token_budget(3, 200.0) == 512  # a GPU
    assert PrefillRate(budget=512, tokens_per_s=10.0).token_budget(3, 200.0) == 19  # 3 + 16
    assert PrefillRate(budget=512, tokens_per_s=100.0).token_budget(0, 200.0) == 512  # no decode


def _fail_steps(core, message: str = "injected step failure") -> None:
    """From now on every step of `core` raises, as one would after a CUDA fault."""

    def failing_step() -> list:
        raise RuntimeError(message)

    core.step = failing_step


async def _wait_idle(core, timeout_s: float = 5.0) -> None:
    """A dead loop frees the requests' blocks on the step thread: soon, not at once."""
    for _ in range(int(timeout_s / 0.01)):
        if not core.requests:
            return
        await asyncio.sleep(0.01)


def test_health_check_passes_while_the_loop_runs_and_fails_once_a_step_raised(
    make_tiny_engine,
):
    from kvserve.workers.errors import EngineDeadError, EngineShutdownError

    core = make_tiny_engine()
    params = {"max_tokens": 400, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        engine.check_health()  # no loop yet: nothing has died
        stream = engine.generate(prompt_token_ids=list(range(10, 30)), params=params)
        for _ in range(3):
            await anext(stream)
            engine.check_health()  # the loop runs
        _fail_steps(core, "CUDA error: an illegal memory access")
        with pytest.raises(EngineDeadError, match="illegal memory access") as err:
            async for _ in stream:  # outputs already queued may come first
                pass
        assert isinstance(err.value, EngineShutdownError)  # UNAVAILABLE: retry elsewhere
        with pytest.raises(EngineDeadError, match="illegal memory access") as err:
            engine.check_health()
        assert isinstance(err.value.__cause__, RuntimeError)
        # a request after the death fails at once, it does not wait for a loop that is gone
        with pytest.raises(EngineDeadError, match="step loop died"):
            await asyncio.wait_for(anext(engine.generate(prompt_token_ids=[5, 6],
                                                         params=params)), timeout=5)
        await _wait_idle(core)
        assert_engine_idle(core)  # the dead loop's requests gave their blocks back
        await engine.shutdown()
        with pytest.raises(EngineShutdownError):
            engine.check_health()

    asyncio.run(scenario())


def test_a_cancelled_step_loop_is_dead_and_fails_open_and_new_requests(make_tiny_engine):
    from kvserve.workers.errors import EngineDeadError

    core = make_tiny_engine()
    params = {"max_tokens": 400, "ignore_eos": True}

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        stream = engine.generate(prompt_token_ids=[10, 11, 12], params=params)
        await anext(stream)
        engine._loop_task.cancel()  # what "the loop ended" means besides a raising step
        await asyncio.sleep(0)
        with pytest.raises(EngineDeadError, match="cancelled"):
            engine.check_health()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(anext(engine.generate(prompt_token_ids=[5],
                                                         params=params)), timeout=5)
        await _wait_idle(core)
        assert_engine_idle(core)
        await engine.shutdown()

    asyncio.run(scenario())


def test_warm_up_runs_a_request_end_to_end_and_leaves_nothing_behind(make_tiny_engine):
    # one-token blocks and a 2-token step budget: a warm-up that cached blocks, recorded KV
    # events, counted prefix queries or kept its cold step's throughput would show
    core = make_tiny_engine(enable_prefix_caching=True, block_size=1, max_num_batched_tokens=2)
    core.kv_events.enabled = True

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        result = await engine.warm_up()
        assert engine.warmed_up == result
        assert result.generated_tokens == 2 and result.prompt_tokens > 0 and result.seconds > 0
        assert_engine_idle(core)
        assert core.block_manager.cached_hashes() == {"device": [], "host": []}
        assert core.kv_events.drain() == []
        stats = core.kv_stats()
        assert (stats.prefix_queried_tokens, stats.device_cached) == (0, 0)
        assert core.prefill_rate.tokens_per_s is None
        engine.check_health()
        # and the settings it turned off are back: a user request caches and is measured
        outs = [o async for o in engine.generate(prompt_token_ids=[10, 11, 12],
                                                 params={"max_tokens": 2})]
        assert outs[-1].finish_reason == "length"
        assert core.kv_stats().device_cached > 0 and core.kv_events.drain()
        assert core.prefill_rate.tokens_per_s is not None
        await engine.shutdown()

    asyncio.run(scenario())


def test_a_warm_up_whose_step_fails_raises_and_restores_prefix_caching(make_tiny_engine):
    from kvserve.workers.errors import EngineDeadError

    core = make_tiny_engine(enable_prefix_caching=True)
    _fail_steps(core, "no kernel image is available for execution on the device")

    async def scenario() -> None:
        engine = AsyncLLMEngine(core)
        with pytest.raises(EngineDeadError, match="no kernel image"):
            await engine.warm_up()
        assert core.block_manager.enable_caching and engine.warmed_up is None
        await engine.shutdown()
        assert_engine_idle(core)

    asyncio.run(scenario())
