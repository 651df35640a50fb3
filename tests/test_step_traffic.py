"""A decode step's host<->device traffic: one copy in, one sync out, whatever the batch size.

On a GPU every tensor built from host lists is a host->device copy, and every read of a device
value on the host (`.tolist()`, `.item()`, `int(t)`) waits for the device to finish. The step
builds all its integer inputs into one buffer (`attention.metadata.build`), the sampler sends its
per-row parameters in one tensor, and the step reads back one tensor (tokens and logprobs). The
counter (`tests.helpers.HostTraffic`) sees every such call on any device, so CPU CI holds the GPU
path to it.
"""

from __future__ import annotations

import pytest
import torch

from kvserve.workers.model_executor.attention.flash_backend import FlashAttention
from kvserve.workers.model_executor.attention.flash_checks import reference_provider, use_backend
from kvserve.workers.model_executor.rope import RopeSpan
from kvserve.workers.model_executor.sampler import full_vocabulary_sort
from tests.helpers import HostTraffic

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MIX = [  # greedy, seeded top-p with logprobs, penalised: every sampler path
    {"temperature": 0.0},
    {"temperature": 0.8, "top_p": 0.9, "seed": 1, "logprobs": 2},
    {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.2, "seed": 2},
]


def _decode_step_traffic(engine, requests: int) -> tuple[HostTraffic, object]:
    """Counts for one decode-only step of `requests` running sequences."""
    for i in range(requests):
        engine.add_request(prompt_token_ids=[100 + i, 200 + i, 300 + i],
                           params={**MIX[i % len(MIX)], "max_tokens": 8, "ignore_eos": True})
    engine.step()  # the prompts
    seen = []
    prepare = engine.runner.prepare
    engine.runner.prepare = lambda chunks: seen.append(prepare(chunks)) or seen[-1]
    try:
        with HostTraffic() as traffic:
            outs = engine.step()
    finally:
        del engine.runner.prepare
    assert len(outs) == requests and not seen[-1].meta.prefills, "a decode-only step"
    for rid in list(engine.requests):
        engine.abort(rid)
    return traffic, seen[-1].meta


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_a_decode_step_makes_one_sync_and_a_fixed_number_of_host_tensors(make_tiny_engine,
                                                                         backend):
    """With top-k/top-p as a GPU runs them (one sort of the whole vocabulary); what a CPU's
    candidates add is the next test's."""
    engine = make_tiny_engine(attention_backend=backend)
    with full_vocabulary_sort():
        small, _ = _decode_step_traffic(engine, 3)
        large, _ = _decode_step_traffic(engine, 12)
    assert small.syncs == large.syncs == 1, (small.calls, large.calls)
    # the step's integers (1) and the sampler's per-row parameters (1)
    assert small.creations == large.creations == 2, (small.calls, large.calls)
    assert small.transfers == large.transfers


def test_on_a_cpu_the_top_k_top_p_candidates_add_one_flag_read_and_no_host_tensor(
        make_tiny_engine):
    """On a CPU, where reading a tensor waits for nothing, the sampler tries top-k/top-p on each
    row's most likely tokens first and reads back one flag: whether they decided every row
    (then, for rows they did not, the rows' positions). No tensor is built from host data and
    none is moved."""
    engine = make_tiny_engine()
    with full_vocabulary_sort():
        sorted_, _ = _decode_step_traffic(engine, 6)
    tried, _ = _decode_step_traffic(engine, 6)
    assert tried.syncs == sorted_.syncs + 1, (tried.calls, sorted_.calls)
    assert tried.calls["__bool__"] == sorted_.calls["__bool__"] + 1
    assert tried.calls["topk"] == sorted_.calls["topk"] + 1  # the candidates were tried
    assert (tried.creations, tried.transfers) == (sorted_.creations, sorted_.transfers)


def test_dynamic_rope_adds_no_sync_and_the_counter_sees_one_that_would(make_tiny_engine):
    """Dynamic RoPE needs each chunk's start and prompt length: the runner hands them over from
    the host. The negative control reads the lengths from the device tensor instead, as a
    lookup without them would: a sync per chunk, and the counter must see it."""
    engine = make_tiny_engine(checkpoint_kwargs={"rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0}})
    with full_vocabulary_sort():  # as a GPU samples (the test above)
        traffic, _ = _decode_step_traffic(engine, 4)
    assert traffic.syncs == 1
    positions = torch.tensor([5, 9, 700, 3])  # four chunks of one token, one past 512
    with HostTraffic() as control:
        spans = [RopeSpan(int(p), 1, int(p) + 1) for p in positions]
        engine.runner.rope.lookup(positions, spans)
    assert control.syncs >= 4


def test_the_decode_mask_is_built_only_for_the_torch_backend(make_tiny_engine):
    """Unequal decode lengths: the torch backend's SDPA needs a padding mask; the flash kernels
    take the lengths and must not cost the step a mask."""
    torch_engine = make_tiny_engine(attention_backend="torch")
    flash_engine = use_backend(make_tiny_engine(attention_backend="torch"),
                               FlashAttention(reference_provider("torch-varlen")))

    def step_meta(engine):
        engine.add_request(prompt_token_ids=[5, 6, 7], params={"max_tokens": 4})
        engine.add_request(prompt_token_ids=[5, 6, 7, 8, 9], params={"max_tokens": 4})
        engine.step()  # the prompts
        seen = []
        prepare = engine.runner.prepare
        engine.runner.prepare = lambda chunks: seen.append(prepare(chunks)) or seen[-1]
        engine.step()  # both decode
        del engine.runner.prepare
        for rid in list(engine.requests):
            engine.abort(rid)
        return seen[-1].meta

    with_torch, with_flash = step_meta(torch_engine), step_meta(flash_engine)
    assert not with_torch.decode_lens_equal
    assert "decode_mask" in with_torch.__dict__, "the torch backend built and cached it"
    assert "decode_mask" not in with_flash.__dict__, "the flash backend never asked for it"
