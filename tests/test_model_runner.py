"""The model runner (kvserve/workers/model_executor/model_runner.py) on a tiny random Llama:
how a step's chunks become tensors (`prepare`), and that the KV a chunk writes through its
block table is what its later chunks, and only they, read (`forward`)."""

from __future__ import annotations

import pytest
import torch

from kvserve.workers.core.scheduler import ScheduledChunk
from tests.helpers import make_seq

pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 4


@pytest.fixture
def runner(make_tiny_engine):
    engine = make_tiny_engine(block_size=BLOCK, num_kv_blocks=32, dtype="float32")
    return engine.runner


def _seq(request_id: str, prompt_len: int, blocks: list[int], offset: int = 0):
    """A sequence of prompt tokens 1+offset..prompt_len+offset holding `blocks`."""
    seq = make_seq(request_id, prompt_len)
    seq.token_ids[:] = [t + offset for t in seq.token_ids]
    seq.block_table = list(blocks)
    return seq


def _run(runner, chunks: list[ScheduledChunk]) -> torch.Tensor:
    """One step's forward; afterwards every chunk's tokens count as computed."""
    logits = runner.forward(runner.prepare(chunks))
    for c in chunks:
        c.seq.num_computed_tokens += c.num_tokens
    return logits


def test_prepare_puts_decodes_first_and_maps_each_token_to_its_block_slot(runner):
    prefill = _seq("prefill", 6, [7, 2])  # blocks out of order: slots follow the table
    decode = _seq("decode", 5, [5, 9])
    decode.num_computed_tokens = 4  # its last prompt token is left: a decode
    inp = runner.prepare([ScheduledChunk(prefill, 6), ScheduledChunk(decode, 1)])
    assert [c.seq.request_id for c in inp.chunks] == ["decode", "prefill"]
    assert inp.positions.tolist() == [4, 0, 1, 2, 3, 4, 5]
    assert inp.input_ids.tolist() == [5, 1, 2, 3, 4, 5, 6]
    # slot = block * block_size + position within the block
    assert inp.meta.slot_mapping.tolist() == [9 * BLOCK + 0,
                                              *(7 * BLOCK + p for p in range(4)),
                                              2 * BLOCK + 0, 2 * BLOCK + 1]
    assert inp.logits_rows.tolist() == [0, 6]  # each sampling chunk's last row
    assert [c.seq.request_id for c in inp.sampling] == ["decode", "prefill"]


def test_a_partial_prefill_samples_nothing_and_drafts_add_a_row_each(runner):
    partial = _seq("partial", 8, [0, 1])
    spec = _seq("spec", 5, [2, 3])
    spec.num_computed_tokens = 4
    inp = runner.prepare([ScheduledChunk(partial, 4), ScheduledChunk(spec, 3, [11, 12])])
    assert [c.seq.request_id for c in inp.sampling] == ["spec"]
    assert inp.input_ids.tolist()[:3] == [5, 11, 12]  # the last token, then its drafts
    assert inp.logits_rows.tolist() == [0, 1, 2]  # one logits row per draft, and one more


def test_a_prompt_in_chunks_gives_the_logits_of_one_pass(runner):
    """The second chunk reads the first chunk's KV through the block table (non-contiguous
    blocks), so its last logits equal those of the whole prompt computed at once. Negative
    control: the same chunk without the first one's KV (fresh blocks) gives other logits."""
    whole = _run(runner, [ScheduledChunk(_seq("whole", 11, [0, 1, 2]), 11)])
    chunked = _seq("chunked", 11, [10, 4, 8])
    _run(runner, [ScheduledChunk(chunked, 5)])
    last = _run(runner, [ScheduledChunk(chunked, 6)])
    torch.testing.assert_close(last, whole, rtol=1e-5, atol=1e-5)
    blind = _seq("blind", 11, [20, 21, 22])  # blocks never written
    blind.num_computed_tokens = 5
    assert not torch.allclose(_run(runner, [ScheduledChunk(blind, 6)]), whole, atol=1e-3)


def test_a_request_reads_only_its_own_blocks_whatever_is_batched_with_it(runner):
    """A decode's logits are the same alone and beside another request's prefill and
    decode with different prompts: each reads its own block table, bit for bit."""
    def decode_logits(neighbours: bool) -> torch.Tensor:
        mine = _seq("mine", 6, [3, 9])
        _run(runner, [ScheduledChunk(mine, 5)])
        chunks = [ScheduledChunk(mine, 1)]
        if neighbours:
            other = _seq("other", 7, [12, 13], offset=20)
            _run(runner, [ScheduledChunk(other, 6)])
            chunks += [ScheduledChunk(other, 1), ScheduledChunk(_seq("new", 9, [14, 15, 16],
                                                                     offset=40), 9)]
        return _run(runner, chunks)[0]

    assert torch.equal(decode_logits(False), decode_logits(True))
