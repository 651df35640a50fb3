"""The scheduler (kvserve/workers/core/scheduler.py): what it admits and batches, and
`update_from_output`, where the stop checks live."""

from __future__ import annotations

from kvserve.workers.core.block_manager import BlockManager
from kvserve.workers.core.scheduler import Scheduler
from kvserve.workers.core.sequence import FinishReason
from tests.helpers import make_seq


def test_update_from_output_applies_the_step_and_runs_the_stop_checks() -> None:
    """The scheduler, not the engine, decides who stops: a stop string wins over a length
    limit in the same token, EOS counts unless ignore_eos, stop_token_ids always; a finished
    sequence's blocks are freed at once, and the others go on with their token appended."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=100,
                      eos_token_ids={2})
    seqs = {
        "goes_on": make_seq("goes_on", 5, max_tokens=5),
        "length": make_seq("length", 5, max_tokens=1),
        "stop_string_and_length": make_seq("stop_string_and_length", 5, max_tokens=1),
        "eos": make_seq("eos", 5, max_tokens=5),
        "eos_ignored": make_seq("eos_ignored", 5, max_tokens=5, ignore_eos=True),
        "stop_id": make_seq("stop_id", 5, max_tokens=5, stop_token_ids=[7]),
    }
    for seq in seqs.values():
        sched.add(seq)
    scheduled = sched.schedule()
    assert [c.seq.request_id for c in scheduled.chunks] == list(seqs)
    tokens = {"goes_on": 9, "length": 9, "stop_string_and_length": 9, "eos": 2,
              "eos_ignored": 2, "stop_id": 7}
    reasons = sched.update_from_output(
        scheduled, list(seqs.values()), [[t] for t in tokens.values()],
        stop_string=lambda seq, token: seq.request_id == "stop_string_and_length")
    assert dict(zip(seqs, reasons, strict=True)) == {
        "goes_on": None, "length": FinishReason.LENGTH,
        "stop_string_and_length": FinishReason.STOP, "eos": FinishReason.STOP,
        "eos_ignored": None, "stop_id": FinishReason.STOP}
    assert sched.running == [seqs["goes_on"], seqs["eos_ignored"]]
    for name, seq in seqs.items():
        assert seq.output_token_ids == [tokens[name]] and seq.num_computed_tokens == 5
        assert seq.is_finished == (name not in ("goes_on", "eos_ignored"))
        assert (seq.block_table == []) == seq.is_finished
    assert bm.num_free == 16 - 2 * 2  # the two running hold 2 blocks each (5 tokens)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_decoding) == (2, 0, 2)
    assert stats.prompt_tokens_left == 0  # two decodes: no prompt work ahead


def test_update_from_output_stops_at_the_context_limit() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=6)
    seq = make_seq("a", 5, max_tokens=100)
    sched.add(seq)
    assert sched.update_from_output(sched.schedule(), [seq], [[9]]) == [FinishReason.LENGTH]
    assert seq.num_tokens == 6 and bm.num_free == 8


def test_scheduler_stats_count_the_waiting_work() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=1, max_num_batched_tokens=64)
    first, second = make_seq("first", 5, max_tokens=3), make_seq("second", 10, max_tokens=7)
    sched.add(first)
    sched.add(second)
    sched.schedule()  # admits only `first` (max_num_seqs=1)
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.waiting_kv_blocks == 5  # second at its longest: 17 tokens in blocks of 4
    assert stats.prompt_tokens_left == 5 + 10  # first's prompt is scheduled, not yet computed
    assert stats.num_decoding == 0


def test_chunked_prefill_fills_the_budget_decodes_first() -> None:
    """Running sequences are scheduled before waiting ones; a prompt longer than what is left
    of the token budget is chunked, and the next step goes on where the chunk ended."""
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    first, second = make_seq("first", 3, max_tokens=4), make_seq("second", 10, max_tokens=4)
    sched.add(first)
    out = sched.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in out.chunks] == [("first", 3)]
    sched.update_from_output(out, [first], [[9]])
    sched.add(second)
    out = sched.schedule()  # first decodes (1 token), second gets the 7 left of 8
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("first", 3, 1), ("second", 0, 7)]
    assert not out.chunks[1].samples  # a partial prefill samples nothing
    sched.update_from_output(out, [first], [[9]])
    out = sched.schedule()
    assert [(c.seq.request_id, c.start, c.num_tokens) for c in out.chunks] == [
        ("first", 4, 1), ("second", 7, 3)]


def test_max_num_seqs_bounds_the_running_batch() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=64)
    seqs = [make_seq(f"s{i}", 2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    out = sched.schedule()
    assert [s.request_id for s in out.admitted] == ["s0", "s1"]
    assert list(sched.waiting) == [seqs[2]]


def test_out_of_blocks_preempts_the_latest_admitted_and_admits_nobody() -> None:
    """When a running sequence cannot grow, the most recently admitted one is preempted (its
    blocks freed for recompute, no host tier here) and goes back to the front of the queue;
    no waiting request is admitted in that step."""
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    old, new = make_seq("old", 8, max_tokens=8), make_seq("new", 8, max_tokens=8)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert [s.request_id for s in out.admitted] == ["old", "new"] and bm.num_free == 0
    sched.update_from_output(out, [old, new], [[9], [9]])  # both need a third block next
    late = make_seq("late", 2)
    sched.add(late)
    out = sched.schedule()
    assert out.preempted == [new] and sched.num_preemptions == 1
    assert [c.seq.request_id for c in out.chunks] == ["old"] and not out.admitted
    assert list(sched.waiting) == [new, late]
    assert new.num_computed_tokens == 0 and new.block_table == []
