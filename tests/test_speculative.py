"""Speculative decoding: proposers, exact verification, the ledger, the surfaces.

The engine under test is the tiny random model, made peaked (`initializer_range` 1.0 over a
1,024-token vocabulary) so that sampled distributions have few enough outcomes for a chi-square
test, and drafts are sometimes right and often wrong. The real model's greedy exactness with
speculation is in tests/test_greedy_exact.py.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvserve.workers.config import EngineConfig
from kvserve.workers.core.ngram_proposer import LookupCeiling, NgramProposer, lookup_ceiling
from kvserve.workers.engine import LLMEngine, _next_spec_len
from kvserve.workers.model_executor import rejection_sampler
from kvserve.workers.model_executor.rejection_sampler import Verified
from kvserve.workers.model_executor.tiny import synthetic_tokenizer, tiny_checkpoint
from tests.helpers import assert_engine_idle, output_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 1024
BLOCK = 4
NGRAM = {"speculative_method": "ngram", "prompt_lookup_min": 1, "prompt_lookup_max": 2}
DRAFT = {"speculative_method": "draft_model"}
# three sampling settings, one per filter (top-p, top-k with a repetition penalty, min-p)
SAMPLED = {
    "temperature+top_p": {"temperature": 0.9, "top_p": 0.8},
    "top_k+repetition_penalty": {"temperature": 1.0, "top_k": 8, "repetition_penalty": 1.3},
    "min_p": {"temperature": 1.0, "min_p": 0.1},
}


def _noisy(ckpt, scale: float, seed: int = 1):
    """`ckpt` with Gaussian noise of `scale` times each weight matrix's spread added."""
    g = torch.Generator().manual_seed(seed)
    return dataclasses.replace(ckpt, tensors={
        k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v
        for k, v in ckpt.tensors.items()})


@pytest.fixture(scope="module")
def checkpoints():
    """The peaked target; drafts for it: an unrelated random model (nearly every draft
    rejected) and the target with 5 % noise (about one draft in five accepted); and a tiny
    model at transformers' default initialisation, which repeats its last token, so prompt
    lookup's drafts are often right."""
    tok = synthetic_tokenizer(VOCAB)
    target = tiny_checkpoint("llama", seed=0, tokenizer=tok, initializer_range=1.0,
                             vocab_size=VOCAB)
    return {"target": target,
            "random_draft": tiny_checkpoint("llama", seed=1, tokenizer=tok,
                                            initializer_range=1.0, vocab_size=VOCAB),
            "noisy_draft": _noisy(target, 0.05),
            "repeating": tiny_checkpoint("llama", seed=0, tokenizer=tok, vocab_size=VOCAB)}


@pytest.fixture(scope="module")
def make(checkpoints) -> Callable[..., LLMEngine]:
    """An engine on `target`: `draft` names the draft checkpoint (None: the target itself)."""

    def build(draft: str | None = None, target: str = "target", **settings: Any) -> LLMEngine:
        settings = {"device": "cpu", "block_size": BLOCK, "kv_cache_memory": 8 * 1024**2,
                    "max_num_seqs": 64, "max_num_batched_tokens": 512, **settings}
        return LLMEngine(EngineConfig(**settings), checkpoint=checkpoints[target],
                         draft_checkpoint=checkpoints[draft] if draft else None)

    return build


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves, so prompt lookup finds n-grams to copy."""
    out = []
    for i in range(6):
        base = [(17 * i + 31 * j) % (VOCAB - 3) + 3 for j in range(7 + i)]
        out.append(base + base[: 3 + i % 3] + [(5 * i) % 97 + 3] + base)
    return out


def _run(engine: LLMEngine, params: dict[str, Any], prompts: list[list[int]] | None = None,
         seed0: int = 0) -> list[list[int]]:
    """Every prompt as one concurrent batch, each with its own seed; the output token ids."""
    prompts = prompts or _prompts()
    requests = [{"prompt_token_ids": p, "request_id": f"r{i}",
                 "params": {"max_tokens": 24, "ignore_eos": True, "seed": seed0 + i, **params}}
                for i, p in enumerate(prompts)]
    outs = engine.generate_all(requests)
    assert_engine_idle(engine)
    return [output_ids(outs[f"r{i}"]) for i in range(len(prompts))]


# -- prompt lookup ------------------------------------------------------------------------------


def test_prompt_lookup_copies_what_followed_the_longest_most_recent_match():
    p = NgramProposer(min_n=2, max_n=3)
    assert p.lookup([1, 2, 3, 4, 5, 9, 1, 2, 3], 3) == [4, 5, 9]  # 3-gram 1 2 3
    # the 2-gram [2, 3] occurs twice; the most recent one is followed by 4 7 2
    assert p.lookup([2, 3, 9, 8, 2, 3, 4, 7, 2, 3], 3) == [4, 7, 2]
    # a 3-gram match beats a more recent 2-gram one
    assert p.lookup([5, 2, 3, 8, 1, 2, 3, 6, 5, 2, 3], 2) == [8, 1]
    assert p.lookup([1, 2, 3, 4], 3) == []  # nothing recurs
    assert p.lookup([7, 1, 7], 3) == []  # a 1-gram is below prompt_lookup_min
    assert NgramProposer(1, 1).lookup([7, 1, 7], 3) == [1, 7]  # the run reaches the end
    assert p.lookup([1, 2, 3, 1, 2], 0) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=5, prompt_lookup_max=4)


def test_the_lookup_ceiling_counts_the_fewest_steps_by_hand():
    # the first output token comes from prefill; then 2 (in the prompt) is followed by 3 4 5:
    # one step accepts 3 4 5 and adds 7 itself
    c = lookup_ceiling([1, 2, 3, 4, 5], [2, 3, 4, 5, 7], k=4)
    assert (c.decode_tokens, c.fewest_steps, c.tokens_per_step) == (4, 1, 4.0)
    # k bounds a step: 2 drafts, then 2 more
    assert lookup_ceiling([1, 2, 3, 4, 5], [2, 3, 4, 5, 7], k=2).fewest_steps == 2
    # nothing recurs: one token per step
    assert lookup_ceiling([1, 2, 3], [4, 5, 6, 7], k=4).tokens_per_step == 1.0
    # the oracle picks the right one of two occurrences of 9 (a proposer taking the most recent
    # would draft 8): 9 -> 1 2 3, then 3 ends and "6" is the step's own token
    assert lookup_ceiling([9, 1, 2, 3, 0, 9, 8], [9, 1, 2, 3, 6], k=4).fewest_steps == 1
    # a draft may be the last token itself (EOS ends the request inside an accepted run)
    assert lookup_ceiling([5, 6, 7], [5, 6, 7], k=4).fewest_steps == 1
    assert lookup_ceiling([1], [2], k=4) == LookupCeiling(0, 0)


@pytest.mark.parametrize("min_n,max_n,k", [(1, 1, 4), (2, 4, 4), (1, 3, 2), (3, 3, 6)])
def test_no_prompt_lookup_proposer_beats_the_lookup_ceiling(min_n, max_n, k):
    """The ceiling is a bound: on random token streams that repeat themselves (a vocabulary of
    6), prompt lookup at fixed k and with the engine's adaptive k never takes fewer steps.
    Negative control: the ceiling is reached on some streams and not on others (it is not
    merely a loose number), and it is above one token per step."""
    gen = np.random.default_rng(0)
    proposer = NgramProposer(min_n, max_n)
    reached = beaten = 0
    for _ in range(60):
        prompt = gen.integers(0, 6, size=int(gen.integers(2, 30))).tolist()
        output = gen.integers(0, 6, size=int(gen.integers(2, 40))).tolist()
        ceiling = lookup_ceiling(prompt, output, k)
        for adaptive in (False, True):
            n, steps, want = 1, 0, k
            while n < len(output):
                drafts = proposer.lookup(prompt + output[:n], min(want, len(output) - n))
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == output[n + accepted]:
                    accepted += 1
                n, steps = n + accepted + 1, steps + 1
                if adaptive and drafts:  # the engine's own schedule
                    want = _next_spec_len(Verified([], num_drafts=len(drafts),
                                                   num_accepted=accepted), k)
            assert steps >= ceiling.fewest_steps, (prompt, output)
            reached += steps == ceiling.fewest_steps
            beaten += steps > ceiling.fewest_steps
    assert reached and beaten


# -- exactness: the same tokens, greedy and seeded ------------------------------------------------


PROPOSERS = {  # (target, draft, settings)
    "ngram": ("repeating", None, {**NGRAM, "num_speculative_tokens": 3}),
    "draft=target": ("target", None, {**DRAFT, "num_speculative_tokens": 4}),
    "noisy draft": ("target", "noisy_draft", {**DRAFT, "num_speculative_tokens": 3}),
    "random draft": ("target", "random_draft", {**DRAFT, "num_speculative_tokens": 3}),
}


@pytest.mark.parametrize("method", list(PROPOSERS))
def test_every_proposer_leaves_the_tokens_unchanged(make, method):
    """Greedy output and every seeded sampled output are the very tokens the engine writes
    without speculation, for prompts decoding side by side, whatever share of the drafts the
    target accepts: all (the target as its own greedy draft), some, or next to none."""
    target, draft, settings = PROPOSERS[method]
    plain, spec = make(target=target), make(draft, target=target, **settings)
    for name, params in {"greedy": {"temperature": 0.0}, **SAMPLED}.items():
        assert _run(spec, params) == _run(plain, params), name
        if method == "draft=target" and name == "greedy":
            stats = spec.spec_stats
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
    stats = spec.spec_stats
    assert stats.num_draft_tokens > 0
    if method != "random draft":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    else:  # drafts that keep failing shrink to one token a step (the adaptive draft length)
        assert stats.num_draft_tokens < 1.3 * stats.num_drafts, stats
    # the draft's KV pool is empty again: every request's draft blocks were given back
    if spec.config.speculative_method == "draft_model":
        kv = spec.proposer.kv
        assert kv.num_free == kv.num_blocks and not spec.proposer.shadows


def _chi_square_p(a: Counter, b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (outcomes with fewer than 10 samples in all
    are pooled into one): the p-value that `a` and `b` come from the same distribution."""
    rare = {k for k in a | b if a[k] + b[k] < 10}
    cats = sorted({k for k in a | b if k not in rare}) + (["rare"] if rare else [])

    def count(c: Counter, k) -> int:
        return sum(c[r] for r in rare) if k == "rare" else c[k]

    na, nb = sum(a.values()), sum(b.values())
    stat = 0.0
    for k in cats:
        total = count(a, k) + count(b, k)
        for n, observed in ((na, count(a, k)), (nb, count(b, k))):
            expected = total * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    df = len(cats) - 1
    if df == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _token_counts(engine: LLMEngine, params: dict[str, Any], seeds: range
                  ) -> list[Counter]:
    """Over many seeds of one prompt: how often each first, second and third token came."""
    prompt = _prompts()[1]
    outs = engine.generate_all([
        {"prompt_token_ids": prompt, "request_id": f"s{s}",
         "params": {**params, "max_tokens": 3, "ignore_eos": True, "seed": s}} for s in seeds])
    seqs = [output_ids(o) for o in outs.values()]
    return [Counter(s[i] for s in seqs) for i in range(3)]


SEEDS = 2000


@pytest.mark.parametrize("setting", list(SAMPLED))
def test_sampled_distributions_match_the_engine_without_speculation(make, setting, monkeypatch):
    """First, second and third token over 2,000 seeds each, with the noisy tiny draft (most
    drafts rejected, some accepted), against the plain engine on other seeds: a chi-square
    test of homogeneity at each position. Negative control: a verifier that accepts every
    draft fails it."""
    params = SAMPLED[setting]
    plain = make(enable_prefix_caching=True)
    spec = make("noisy_draft", **DRAFT, num_speculative_tokens=2, enable_prefix_caching=True)
    reference = _token_counts(plain, params, range(SEEDS, 2 * SEEDS))
    got = _token_counts(spec, params, range(SEEDS))
    stats = spec.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for i in range(3):
        p = _chi_square_p(got[i], reference[i])
        assert p > 1e-3, f"{setting}: token {i + 1} distribution differs, p = {p:.2e}"

    # negative control: keep every draft, as if the target had sampled it
    verify = rejection_sampler.sample_and_verify

    def accept_every_draft(logits, chunks):
        return [rejection_sampler.Verified([*c.drafts, v.token_ids[-1]], v.logprobs,
                                           len(c.drafts), len(c.drafts)) if c.drafts else v
                for v, c in zip(verify(logits, chunks), chunks, strict=True)]

    monkeypatch.setattr("kvserve.workers.engine.sample_and_verify", accept_every_draft)
    biased = make("noisy_draft", **DRAFT, num_speculative_tokens=2, enable_prefix_caching=True)
    wrong = _token_counts(biased, params, range(SEEDS))
    assert min(_chi_square_p(wrong[i], reference[i]) for i in (1, 2)) < 1e-3


# -- stops, the ledger, the prefix cache --------------------------------------------------------


def _steps_and_ids(engine: LLMEngine, prompt: list[int], params: dict[str, Any]):
    rid = engine.add_request(prompt_token_ids=prompt, params=params)
    outs, steps = [], 0
    while engine.has_unfinished():
        steps += 1
        outs += engine.step()
    assert_engine_idle(engine)
    assert all(o.request_id == rid for o in outs)
    return steps, outs


def test_a_stop_inside_an_accepted_run_cuts_it_there(make):
    """With the target as its own draft every greedy draft is accepted, five tokens a step; a
    stop token, a stop string or max_tokens falling inside such a run ends the output exactly
    where decoding one token a step ends it."""
    plain, spec = make(), make(**DRAFT, num_speculative_tokens=4)
    prompt = _prompts()[2]
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    _, outs = _steps_and_ids(plain, prompt, greedy)
    full = output_ids(outs)
    steps, outs = _steps_and_ids(spec, prompt, greedy)
    assert output_ids(outs) == full and steps < len(full) / 3  # runs of accepted drafts
    text = plain.tokenizer.decode(full)
    at = 7  # inside the second step's run of five
    stop_text = plain.tokenizer.decode([full[at]]).strip()
    cases = {"stop_token_ids": {"stop_token_ids": [full[at]]},
             "stop": {"stop": [stop_text]},
             "max_tokens": {"max_tokens": at + 1}}
    for name, extra in cases.items():
        params = {**greedy, **extra}
        want = _steps_and_ids(plain, prompt, params)[1]
        got = _steps_and_ids(spec, prompt, params)[1]
        assert output_ids(got) == output_ids(want), name
        assert "".join(o.text for o in got) == "".join(o.text for o in want), name
        assert got[-1].finish_reason == want[-1].finish_reason, name
        assert len(output_ids(got)) <= at + 1, name
        assert got[-1].usage.completion_tokens == len(output_ids(want))
    assert stop_text in text


def test_only_accepted_tokens_reach_the_prefix_cache(make):
    """Prefix caching on: after the same requests, the speculating engine's cache holds
    exactly the block hashes of the plain engine's (rejected drafts were written to KV slots,
    never registered), and a repeat of a finished request hits them."""
    settings = {"enable_prefix_caching": True}
    plain = make(**settings)
    spec = make("noisy_draft", **DRAFT, num_speculative_tokens=3, **settings)
    for params in ({"temperature": 0.0}, SAMPLED["min_p"]):
        assert _run(spec, params) == _run(plain, params)
    assert spec.spec_stats.num_accepted_tokens < spec.spec_stats.num_draft_tokens
    ours, theirs = spec.cached_block_hashes(), plain.cached_block_hashes()
    # (as sets: the LRU order differs, blocks fill up in other steps)
    assert set(ours["device"]) == set(theirs["device"]) and len(ours["device"]) > 0
    again = _run(spec, {"temperature": 0.0})
    assert again == _run(plain, {"temperature": 0.0})
    assert spec.kv_stats().prefix_hit_tokens == plain.kv_stats().prefix_hit_tokens > 0


def test_preemption_swaps_and_aborts_mid_speculation_keep_the_ledger(make):
    """A pool too small for the batch: requests are preempted (swapped to the host tier, or
    recomputed) between speculative steps, some are aborted mid-run, and outputs stay the
    plain engine's; afterwards both tiers and the draft's pool are empty."""
    roomy = make()
    prompts = _prompts()
    params = {"temperature": 0.0}
    expected = _run(roomy, params, prompts)
    for host in (0, 2 * 1024**2):  # recompute, then swap
        spec = make("noisy_draft", **DRAFT, num_speculative_tokens=3,
                    num_kv_blocks=40, cpu_offload_memory=host, max_num_seqs=8)
        assert _run(spec, params, prompts) == expected
        assert spec.kv_stats().preemptions > 0
        if host:
            assert spec.kv_stats().blocks_swapped_out > 0
        # aborts while drafts are in flight
        ids = [spec.add_request(prompt_token_ids=p, params={"max_tokens": 24, **params})
               for p in prompts]
        for _ in range(4):
            spec.step()
        assert any(s.num_draft_tokens for s in (spec.requests[i].seq for i in ids))
        for rid in ids[::2]:
            spec.abort(rid)
        while spec.has_unfinished():
            spec.step()
        assert_engine_idle(spec)
        assert spec.proposer.kv.num_free == spec.proposer.kv.num_blocks


# -- what users see -----------------------------------------------------------------------------


def test_opt_out_usage_batch_size_limit_and_the_timeline(make):
    """A request can opt out (`speculate: false`); usage counts each request's verified and
    accepted drafts; above speculative_disable_by_batch_size nobody speculates; the timeline
    shows a verifying decode as one decode of 1 + drafts tokens."""
    spec = make(**DRAFT, num_speculative_tokens=3)
    prompt = _prompts()[0]
    outs = spec.generate_all([
        {"prompt_token_ids": prompt, "request_id": "on", "params": {"temperature": 0.0}},
        {"prompt_token_ids": prompt, "request_id": "off",
         "params": {"temperature": 0.0, "speculate": False}}])
    on, off = outs["on"][-1].usage, outs["off"][-1].usage
    assert output_ids(outs["on"]) == output_ids(outs["off"])
    assert off.draft_tokens == off.accepted_draft_tokens == 0
    assert on.accepted_draft_tokens == on.draft_tokens > 0  # the target agrees with itself
    assert len(outs["on"]) < len(outs["off"])  # several tokens per output
    decodes = [e for e in outs["on"][-1].timeline.events if e.kind == "decode"]
    assert any(e.num_tokens > 1 for e in decodes)
    assert sum(e.num_tokens for e in decodes) - len(decodes) == on.draft_tokens
    # the draft model's passes are the steps' own phase, "propose", not part of "schedule"
    steps = spec.recent_steps()
    plain = make()
    plain.generate_all([{"prompt_token_ids": prompt, "params": {"temperature": 0.0}}])
    # per step, so one step slowed by the other pytest worker (or a GC pause) does not decide;
    # the steps that verified drafts (the request that opted out runs on alone afterwards)
    verifying = [r for r in steps if r.num_decodes and r.num_tokens > r.num_decodes]
    assert len(verifying) >= 3
    proposing = statistics.median(r.propose_s / r.seconds for r in verifying)
    idle = statistics.median(r.propose_s / r.seconds for r in plain.recent_steps()
                             if r.num_decodes)
    # 3 draft passes per step: a median share of ~0.6 on an idle core, where a proposer timed
    # as part of "schedule" leaves the plain engine's ~0.005
    assert proposing > 0.2 and proposing > 10 * idle and idle < 0.02, (proposing, idle)
    assert statistics.median(r.schedule_s / r.propose_s for r in verifying) < 1

    limited = make(**DRAFT, num_speculative_tokens=3, speculative_disable_by_batch_size=1)
    both = limited.generate_all([{"prompt_token_ids": prompt, "params": {"temperature": 0.0}}
                                 for _ in range(2)])
    assert all(o[-1].usage.draft_tokens == 0 for o in both.values())
    alone = limited.generate_all([{"prompt_token_ids": prompt, "params": {"temperature": 0.0}}])
    assert next(iter(alone.values()))[-1].usage.draft_tokens > 0
    with pytest.raises(Exception, match="speculate"):
        spec.add_request(prompt_token_ids=prompt, params={"speculate": "yes"})


def test_the_draft_model_applies_the_requests_penalties(make):
    """The target as its own draft, greedy with a strong repetition penalty: the draft's
    tokens are its penalised argmax, so the target accepts every one (with the raw argmax the
    penalty would make it reject some: checked by hand on these prompts)."""
    spec = make(**DRAFT, num_speculative_tokens=3)
    params = {"temperature": 0.0, "repetition_penalty": 1.8, "presence_penalty": 0.5}
    assert _run(spec, params) == _run(make(), params)
    stats = spec.spec_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
