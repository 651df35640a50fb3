"""The batched sampler, against hand-computed values and a per-row reference, plus
SamplingParams validation.

Expected values are computed by hand, with plain torch (softmax / log_softmax / argmax), or with
the per-row reference below (an unbatched sampler, drawing by inverse CDF from the same one
uniform per row), never with the sampler itself.
"""

from __future__ import annotations

import collections
import math
import random
from typing import Any

import pytest
import torch

from kvserve.workers.core.outputs import TokenLogprobs
from kvserve.workers.core.sampling_params import GREEDY_BELOW, SamplingParams
from kvserve.workers.core.sequence import Sequence
from kvserve.workers.errors import InvalidRequestError
from kvserve.workers.model_executor.sampler import _draw, sample, sampling_probs
from tests.helpers import HostTraffic

NEG_INF = float("-inf")


def make_seq(
    prompt: list[int] | None = None, output: list[int] | None = None, seed: int = 0,
    **params: Any,
) -> Sequence:
    seq = Sequence(
        "r", list(prompt or [0]), SamplingParams(**params), torch.Generator().manual_seed(seed)
    )
    for t in output or []:
        seq.append_token(t)
    return seq


def kept_rows(logits: torch.Tensor, params: list[dict[str, Any]]) -> list[set[int]]:
    """logits: [vocab], one row per params (temperature 1 unless given) -> each row's support."""
    seqs = [make_seq(**{"temperature": 1.0, **p}) for p in params]
    probs = sampling_probs(logits.expand(len(seqs), -1).contiguous(), seqs)
    return [set(torch.nonzero(row).flatten().tolist()) for row in probs]


def probs_of(logits: torch.Tensor, **params: Any) -> torch.Tensor:
    """logits: [vocab] -> [vocab] the distribution the sampler draws from for one row."""
    return sampling_probs(logits[None], [make_seq(**params)])[0]


# -- the per-row reference ------------------------------------------------------------------------
# The pre-batching implementation, one row at a time, with its draw changed from multinomial to
# the inverse CDF of the same single uniform the batched sampler takes from the row's generator.


def _ref_penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def ref_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """logits: [vocab], modified in place."""
    p = seq.params
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        scores = logits[seen]
        logits[seen] = torch.where(
            scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty
        )
    if seq.output_token_ids and (p.presence_penalty or p.frequency_penalty):
        out = torch.tensor(seq.output_token_ids, dtype=torch.long)
        counts = torch.bincount(out, minlength=logits.shape[-1]).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def ref_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, NEG_INF)


def ref_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
    drop = before >= top_p
    drop[0] = False  # always keep the most likely token
    unsorted = torch.empty_like(drop).scatter_(0, order, drop)
    return logits.masked_fill(unsorted, NEG_INF)


def ref_min_p(probs: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return probs
    return probs.masked_fill(probs < min_p * probs.max(), 0.0)


def ref_probs(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """row: [vocab] -> [vocab] unnormalised; greedy: one-hot at the penalised argmax."""
    p = seq.params
    row = ref_penalties(row.clone(), seq) if _ref_penalized(p) else row
    if p.greedy:
        return torch.zeros_like(row).scatter_(0, row.argmax()[None], 1.0)
    row = ref_top_p(ref_top_k(row / p.temperature, p.top_k), p.top_p)
    return ref_min_p(torch.softmax(row, dim=-1), p.min_p)


def ref_logprobs(row: torch.Tensor, token: int, p: SamplingParams) -> TokenLogprobs | None:
    if p.logprobs is None:
        return None
    logp = torch.log_softmax(row, dim=-1)
    top = torch.topk(logp, p.logprobs) if p.logprobs else None
    pairs = list(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else []
    return TokenLogprobs(token, float(logp[token]), pairs)


def ref_sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    tokens: list[int] = []
    for row, seq in zip(logits, seqs, strict=True):
        probs = ref_probs(row, seq)
        if seq.params.greedy:
            tokens.append(int(probs.argmax()))
            continue
        u = torch.rand((), generator=seq.generator)
        cdf = torch.cumsum(probs, dim=-1)
        target = torch.minimum(u * cdf[-1], torch.nextafter(cdf[-1], torch.tensor(0.0)))
        tokens.append(int(torch.searchsorted(cdf, target[None], right=True)))
    pairs = enumerate(zip(tokens, seqs, strict=True))
    lps = [ref_logprobs(logits[i], t, s.params) for i, (t, s) in pairs]
    return tokens, lps


# -- top-k --------------------------------------------------------------------------------------

LOGITS = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, -1.0])  # ranks: 1, 4, 2, 3, 0, 5
TOP_K_CASES = [(1, {1}), (2, {1, 4}), (3, {1, 4, 2}), (5, {1, 4, 2, 3, 0})]


def test_top_k_keeps_exactly_k_in_one_batch() -> None:
    rows = kept_rows(LOGITS, [{"top_k": k} for k, _ in TOP_K_CASES] + [{}])
    assert rows[:-1] == [want for _, want in TOP_K_CASES]
    assert rows[-1] == set(range(6))  # the unfiltered row in the same batch is untouched
    # the survivors keep their relative probabilities
    p = probs_of(LOGITS, top_k=3)
    assert float(p[1] / p[4]) == pytest.approx(math.exp(1.0))
    assert float(p[4] / p[2]) == pytest.approx(math.exp(1.0))


@pytest.mark.parametrize("k", [0, -1, 6, 100])
def test_top_k_off(k: int) -> None:
    assert torch.allclose(probs_of(LOGITS, top_k=k), torch.softmax(LOGITS, -1))


def test_top_k_ties_keep_all_tied() -> None:
    assert kept_rows(torch.tensor([1.0, 3.0, 3.0, 0.0]), [{"top_k": 1}]) == [{1, 2}]
    assert kept_rows(torch.tensor([3.0, 1.0, 3.0, 3.0]), [{"top_k": 2}]) == [{0, 2, 3}]


def test_temperature_comes_before_top_k_and_top_p() -> None:
    # top-k does not care; top-p does: a hot temperature flattens, so 0.6 needs more tokens
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    assert kept_rows(logits, [{"top_p": 0.6, "temperature": 1.0}]) == [{1}]  # 0.61 alone
    assert kept_rows(logits, [{"top_p": 0.6, "temperature": 10.0}]) == [{1, 2, 0}]


# -- top-p --------------------------------------------------------------------------------------

# probabilities 0.5, 0.3, 0.15, 0.05, deliberately out of order
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
P_LOGITS = PROBS.log()
TOP_P_CASES = [
    (1e-9, {1}),  # even a tiny p keeps the most likely token
    (0.3, {1}),
    (0.45, {1}),
    (0.55, {1, 3}),  # 0.5 < 0.55: needs the second
    (0.79, {1, 3}),  # 0.8 reaches it
    (0.81, {1, 3, 0}),
    (0.94, {1, 3, 0}),
    (0.96, {1, 3, 0, 2}),
]


def test_top_p_keeps_smallest_set_reaching_p_in_one_batch() -> None:
    rows = kept_rows(P_LOGITS, [{"top_p": p} for p, _ in TOP_P_CASES])
    assert rows == [want for _, want in TOP_P_CASES]
    p = probs_of(P_LOGITS, top_p=0.85)  # survivors renormalised: 0.5, 0.3, 0.15 over 0.95
    assert p.tolist() == pytest.approx([0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95])


def test_top_p_keeps_top_token_when_it_dominates() -> None:
    assert kept_rows(torch.tensor([0.0, 30.0, 0.0]), [{"top_p": 1e-6}]) == [{1}]
    assert kept_rows(torch.tensor([2.0, 2.0, 2.0, 9.0]), [{"top_p": 0.01}]) == [{3}]


def test_top_p_zero_still_keeps_the_top_token() -> None:
    # p = 0 is rejected by validation, but the sampler's contract holds at the limit
    assert kept_rows(P_LOGITS, [{"top_p": 0.0}]) == [{1}]


def test_top_p_one_is_off() -> None:
    # a flat 1000-token row: the cumulative mass rounds past 1 before the end, and p = 1 must
    # still keep everything
    assert kept_rows(torch.zeros(1000), [{"top_p": 1.0}]) == [set(range(1000))]
    assert torch.allclose(probs_of(P_LOGITS, top_p=1.0), PROBS)
    # sorted for its top-k, a tail token whose mass is lost in the rounding of the cumulative
    # sum (0.5 + 0.5 + 5e-14 is 1.0 in float32, "before" it reaches 1.0) must survive p = 1
    tail = torch.tensor([0.0, 0.0, -30.0, -40.0])
    assert kept_rows(tail, [{"top_k": 3, "top_p": 1.0}]) == [{0, 1, 2}]


def test_top_p_after_top_k() -> None:
    # top-k 2 leaves 0.5 and 0.3 (0.625, 0.375 renormalised): p 0.6 needs both, p 0.55 one
    assert kept_rows(P_LOGITS, [{"top_k": 2, "top_p": 0.55}, {"top_k": 2, "top_p": 0.7}]) == [
        {1}, {1, 3},
    ]


def test_top_p_matches_a_hand_reference_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(3)
    batch, ps, wants, masses = [], [], [], []
    for _ in range(20):
        logits = torch.randn(50, generator=gen) * 3
        p = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        probs = torch.softmax(logits, -1).tolist()
        order = sorted(range(50), key=lambda i: -probs[i])
        want, mass = set(), 0.0
        for i in order:  # smallest prefix of the sorted distribution whose mass reaches p
            want.add(i)
            mass += probs[i]
            if mass >= p:
                break
        batch.append(logits)
        ps.append(p)
        wants.append(want)
        masses.append(mass)
    seqs = [make_seq(temperature=1.0, top_p=p) for p in ps]
    probs = sampling_probs(torch.stack(batch), seqs)
    for row, want, mass, p in zip(probs, wants, masses, ps, strict=True):
        got = set(torch.nonzero(row).flatten().tolist())
        # a boundary within float error may include/exclude one token; otherwise exact
        assert got == want or abs(mass - p) < 1e-5


# -- top-k/top-p on a row's most likely tokens (CPU, large vocabularies) --------------------------


def candidate_cases(vocab: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows that the first m candidates decide and rows that they cannot: peaked and flat
    logits, ties (rounded logits; a top-p cut among tokens tied across the m-th value), a
    masked row (-inf past a few tokens, as a grammar leaves it), and top-k below, at, just past
    and far past m, or off."""
    gen = torch.Generator().manual_seed(17)
    rows, params = [], []
    for scale in (0.3, 3.0, 12.0):
        for rounding in (None, 2.0):
            for k in (1, 5, m - 1, m, m + 1, 3 * m, vocab):
                for p in (0.3, 0.9, 0.999, 1.0):
                    if k >= vocab and p >= 1.0:
                        continue  # neither is on: the sampler never sorts such a row
                    x = torch.randn(vocab, generator=gen) * scale
                    if rounding:
                        x = torch.round(x * rounding) / rounding
                    rows.append(x)
                    params.append([1.0, float(k), p, 0.0, 1.0, 0.0, 0.0])
    masked = torch.full((vocab,), NEG_INF)
    masked[[3, 9, 40]] = torch.tensor([1.0, 2.0, 1.5])
    rows.append(masked)
    params.append([1.0, float(vocab), 0.9, 0.0, 1.0, 0.0, 0.0])
    # one likely token, then 4m tokens tied across the m-th value, and a top-p cut inside them:
    # which tied tokens `topk` returns is its own choice, the sort's are the lowest ids
    tied = torch.full((vocab,), -10.0)
    tied[torch.randperm(vocab, generator=gen)[: 4 * m]] = 0.0
    tied[vocab // 2] = 5.0
    probs = torch.softmax(tied, -1)
    rows.append(tied)
    params.append([1.0, float(vocab), float(probs.max() + 9.5 * probs[tied == 0][0]), 0.0,
                   1.0, 0.0, 0.0])
    return torch.stack(rows), torch.tensor(params)


def test_top_k_top_p_on_the_most_likely_tokens_equals_the_full_sort(monkeypatch) -> None:
    """Each row's kept tokens are the full stable sort's, whether its m candidates decide it or
    the sort does, and both paths are taken. Negative control, by hand: deciding every row on
    its candidates (without the last-value check) keeps other tokens on the flat and tied rows."""
    from kvserve.workers.model_executor import sampler

    vocab, m = 3000, 64
    x, params = candidate_cases(vocab, m)
    sorted_rows = []
    full_sort = sampler._top_k_top_p_sorted

    def counted(rows: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        sorted_rows.append(rows.shape[0])
        return full_sort(rows, p)

    monkeypatch.setattr(sampler, "_top_k_top_p_sorted", counted)
    got = sampler._top_k_top_p_candidates(x, params, m)
    want = full_sort(x, params)
    assert torch.equal(got.isinf(), want.isinf())
    assert torch.equal(got[~got.isinf()], x[~got.isinf()])  # kept logits are left as they were
    assert sorted_rows and 0 < sorted_rows[0] < x.shape[0], sorted_rows  # both paths taken


def test_a_row_cut_on_its_candidates_does_not_depend_on_the_batch() -> None:
    from kvserve.workers.model_executor import sampler

    x, params = candidate_cases(3000, 64)
    together = sampler._top_k_top_p_candidates(x, params, 64)
    for i in range(0, x.shape[0], 7):
        alone = sampler._top_k_top_p_candidates(x[i : i + 1], params[i : i + 1], 64)
        assert torch.equal(alone[0], together[i]), i


def test_seeded_draws_at_smollm2s_vocabulary_are_the_full_sorts() -> None:
    """Through `sample`, on a CPU at 49,152 tokens (where the candidates are tried first): the
    same tokens as with the full sort for every row."""
    from kvserve.workers.model_executor import sampler

    vocab = 49152
    gen = torch.Generator().manual_seed(23)
    scales = torch.tensor([0.5, 4.0, 9.0]).repeat(4)[:, None]  # flat to peaked
    logits = torch.randn(12, vocab, generator=gen) * scales
    kinds = [{"top_k": 40}, {"top_p": 0.9}, {"top_k": 200, "top_p": 0.8}, {"top_p": 0.99}]

    def draws() -> list[list[int]]:
        seqs = [make_seq(seed=i, temperature=0.9, **kinds[i % 4]) for i in range(12)]
        return [sample(logits, seqs)[0] for _ in range(3)]

    assert vocab >= sampler._CANDIDATES_FROM_VOCAB
    tried = draws()
    with sampler.full_vocabulary_sort():
        assert vocab < sampler._CANDIDATES_FROM_VOCAB
        assert tried == draws()
    assert vocab >= sampler._CANDIDATES_FROM_VOCAB


# -- min-p --------------------------------------------------------------------------------------


def test_min_p_threshold_is_relative_to_max_prob() -> None:
    rows = kept_rows(P_LOGITS, [{"min_p": 0.5}, {"min_p": 0.2}, {"min_p": 1.0}, {"min_p": 0.0}])
    assert rows == [{1, 3}, {0, 1, 3}, {1}, {0, 1, 2, 3}]  # thresholds 0.25, 0.1, 0.5, off
    assert probs_of(P_LOGITS, min_p=0.5).tolist() == pytest.approx([0.0, 0.625, 0.0, 0.375])
    # relative, not absolute: with a flat-ish distribution min_p 0.9 keeps near-max tokens
    flat = torch.tensor([0.26, 0.25, 0.25, 0.24]).log()
    assert kept_rows(flat, [{"min_p": 0.9}, {"min_p": 0.95}]) == [{0, 1, 2, 3}, {0, 1, 2}]


def test_min_p_after_top_k() -> None:
    # top-k 3 renormalises 0.5, 0.3, 0.15 over 0.95; min-p 0.35 of the max (0.526) is 0.184
    assert kept_rows(P_LOGITS, [{"top_k": 3, "min_p": 0.35}]) == [{1, 3}]


# -- penalties ----------------------------------------------------------------------------------


def penalised(logits: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """The sampling distribution at temperature 1: softmax of the penalised logits."""
    return probs_of(logits, temperature=1.0, **kwargs)


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0, 0.5])
    got = penalised(logits, prompt=[0, 1, 0], output=[2, 2, 3], repetition_penalty=2.0)
    # seen: 0, 1 (prompt), 2, 3 (output) -- each once, however often it was seen
    want = torch.softmax(torch.tensor([1.0, -4.0, 0.5, -2.0, 3.0, 0.5]), -1)
    assert torch.allclose(got, want)


def test_repetition_penalty_below_one_rewards() -> None:
    got = penalised(torch.tensor([2.0, -2.0, 1.0]), prompt=[0, 1], repetition_penalty=0.5)
    assert torch.allclose(got, torch.softmax(torch.tensor([4.0, -1.0, 1.0]), -1))


def test_presence_and_frequency_from_output_counts_only() -> None:
    got = penalised(
        torch.zeros(6), prompt=[3, 3, 4], output=[0, 0, 1, 0], presence_penalty=0.5,
        frequency_penalty=0.25,
    )
    # token 0: 3 times -> 0.75 + 0.5; token 1: once -> 0.25 + 0.5; prompt tokens 3, 4 untouched
    assert torch.allclose(got, torch.softmax(torch.tensor([-1.25, -0.75, 0, 0, 0, 0.0]), -1))


def test_negative_presence_and_frequency_encourage() -> None:
    got = penalised(torch.zeros(4), output=[2, 2], presence_penalty=-1.0, frequency_penalty=-0.5)
    assert torch.allclose(got, torch.softmax(torch.tensor([0.0, 0.0, 2.0, 0.0]), -1))


def test_presence_without_output_changes_nothing() -> None:
    got = penalised(torch.ones(4), prompt=[1, 2], presence_penalty=2.0, frequency_penalty=2.0)
    assert torch.allclose(got, torch.full((4,), 0.25))


def test_penalties_per_row_with_different_lengths_in_one_batch() -> None:
    # rows of different token counts share a padded block: the padding must not count
    logits = torch.zeros(3, 5)
    seqs = [
        make_seq(temperature=1.0, prompt=[4], output=[0], frequency_penalty=1.0),
        make_seq(temperature=1.0, prompt=[4, 4, 4, 4], output=[1, 1, 2], frequency_penalty=1.0),
        make_seq(temperature=1.0, prompt=[3], output=[3]),  # not penalised
    ]
    got = sampling_probs(logits, seqs)
    want = torch.softmax(torch.tensor([[-1.0, 0, 0, 0, 0], [0, -2.0, -1.0, 0, 0], [0.0] * 5]), -1)
    assert torch.allclose(got, want)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    seq = make_seq(prompt=[1], temperature=0.0, repetition_penalty=2.0)  # 3 -> 1.5 < 2
    assert sample(logits, [seq])[0] == [2]
    seq = make_seq(output=[1], temperature=0.0, presence_penalty=1.5)  # 3 -> 1.5 < 2
    assert sample(logits, [seq])[0] == [2]
    seq = make_seq(prompt=[1], temperature=0.0, presence_penalty=1.5)  # prompt: no effect
    assert sample(logits, [seq])[0] == [1]


def test_sample_leaves_the_logits_alone() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [1.0, 1.0, 4.0, 0.0]])
    before = logits.clone()
    seqs = [
        make_seq(prompt=[1], temperature=0.0, repetition_penalty=2.0, logprobs=1),
        make_seq(prompt=[2], temperature=0.7, top_p=0.5, presence_penalty=1.0),
    ]
    sample(logits, seqs)
    assert torch.equal(logits, before)


# -- the batched sampler against the per-row reference --------------------------------------------

PALETTE: list[dict[str, Any]] = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.4, "logprobs": 3},
    {"temperature": 0.8},
    {"temperature": 0.7, "top_p": 0.9},
    {"temperature": 1.2, "top_k": 20},
    {"temperature": 1.0, "top_k": 40, "top_p": 0.8, "min_p": 0.05},
    {"temperature": 0.9, "min_p": 0.1, "logprobs": 0},
    {"temperature": 1.1, "repetition_penalty": 1.3, "presence_penalty": 0.5, "top_p": 0.95},
    {"temperature": 0.6, "frequency_penalty": 0.7, "logprobs": 5},
    {"temperature": 1.5, "repetition_penalty": 0.8, "frequency_penalty": -0.4, "top_k": 5},
    {"temperature": 1e-6, "presence_penalty": 1.0},  # greedy, with a penalty
    {"temperature": 2.0, "top_p": 0.3, "logprobs": 2},
]


def random_seqs(rng: random.Random, n: int, vocab: int) -> list[Sequence]:
    return [
        make_seq(
            prompt=[rng.randrange(vocab) for _ in range(rng.randint(1, 30))],
            output=[rng.randrange(vocab) for _ in range(rng.randint(0, 12))],
            seed=rng.randrange(2**31),
            **rng.choice(PALETTE),
        )
        for _ in range(n)
    ]


def clone_seqs(seqs: list[Sequence]) -> list[Sequence]:
    out = []
    for s in seqs:
        c = make_seq(prompt=s.prompt_token_ids, output=s.output_token_ids)
        c.params = s.params
        c.generator = torch.Generator().manual_seed(s.generator.initial_seed())
        out.append(c)
    return out


def assert_same_logprobs(
    got: list[TokenLogprobs | None], want: list[TokenLogprobs | None]
) -> None:
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
            continue
        assert g is not None
        assert g.token_id == w.token_id
        assert g.logprob == pytest.approx(w.logprob, abs=1e-5)
        assert [i for i, _ in g.top] == [i for i, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-5)


@pytest.mark.parametrize("trial", range(4))
def test_batched_equals_the_per_row_reference(trial: int) -> None:
    rng = random.Random(trial)
    gen = torch.Generator().manual_seed(trial)
    vocab = 300
    seqs = random_seqs(rng, 12, vocab)
    ref_seqs = clone_seqs(seqs)
    drawn_rows = 0
    for _ in range(6):
        logits = torch.randn(len(seqs), vocab, generator=gen) * 2
        want_probs = torch.stack([ref_probs(r, s) for r, s in zip(logits, ref_seqs, strict=True)])
        want_probs = want_probs / want_probs.sum(-1, keepdim=True)
        assert torch.allclose(sampling_probs(logits, seqs), want_probs, atol=1e-6)
        tokens, lps = sample(logits, seqs)
        want_tokens, want_lps = ref_sample(logits, ref_seqs)
        assert tokens == want_tokens
        assert_same_logprobs(lps, want_lps)
        drawn_rows += sum(not s.params.greedy for s in seqs)
        for s, r, t in zip(seqs, ref_seqs, tokens, strict=True):
            s.append_token(t)
            r.append_token(t)
    assert drawn_rows > 20  # the comparison covered random draws, not only argmaxes


# -- sample(): greedy, seeds, batch independence --------------------------------------------------


def test_temperature_zero_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    seqs = [make_seq(seed=i, temperature=0.0) for i in range(5)]
    tokens, lps = sample(logits, seqs)
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_greedy_ignores_top_k_p_and_generator() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0], [0.0, 1.0, 5.0, 2.0]])
    seq = make_seq(temperature=0.0, top_k=2, top_p=0.1, min_p=0.5)
    penalised_seq = make_seq(prompt=[2], temperature=0.0, top_p=0.1, repetition_penalty=3.0)
    states = [seq.generator.get_state(), penalised_seq.generator.get_state()]
    # a drawn row beside them makes this the full batched path, not the all-greedy shortcut
    drawn = make_seq(temperature=1.0)
    assert sample(logits[:1], [seq])[0] == [2]
    assert sample(torch.cat([logits, logits[:1]]), [seq, penalised_seq, drawn])[0][:2] == [2, 3]
    assert torch.equal(seq.generator.get_state(), states[0])
    assert torch.equal(penalised_seq.generator.get_state(), states[1])


def draws(logits_row: torch.Tensor, seed: int, n: int, **params: Any) -> list[int]:
    seq = make_seq(seed=seed, **params)
    return [sample(logits_row[None], [seq])[0][0] for _ in range(n)]


def test_seeded_sampling_is_reproducible_and_seed_dependent() -> None:
    logits = torch.zeros(1000)  # uniform: draws are all over the vocabulary
    a = draws(logits, 7, 20, temperature=1.0)
    b = draws(logits, 7, 20, temperature=1.0)
    c = draws(logits, 8, 20, temperature=1.0)
    assert a == b
    assert a != c
    assert len(set(a)) > 10


def test_seeded_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    gen = torch.Generator().manual_seed(11)
    batch = torch.randn(4, 500, generator=gen)
    params: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.9, "top_k": 50},
        {"temperature": 1.3, "top_p": 0.8, "repetition_penalty": 1.2},
        {"temperature": 1.0, "min_p": 0.05},
    ]
    seeds = [100, 200, 300, 400]

    def fresh(i: int) -> Sequence:
        return make_seq(prompt=[1, 2, 3], seed=seeds[i], **params[i])

    together_seqs = [fresh(i) for i in range(4)]
    alone_seqs = [fresh(i) for i in range(4)]
    together, alone = [], []
    for _ in range(10):  # several draws: each consumes the row's generator
        together.append(sample(batch, together_seqs)[0])
        alone.append([sample(batch[i : i + 1], [alone_seqs[i]])[0][0] for i in range(4)])
    assert together == alone
    # the batch order does not matter either
    reversed_seqs = [fresh(i) for i in reversed(range(4))]
    first = sample(batch.flip(0), reversed_seqs)[0][::-1]
    assert first == together[0]


@pytest.mark.parametrize("position", ["first", "middle", "last"])
@pytest.mark.parametrize("others", [0, 3, 15])
def test_seeded_row_is_invariant_to_batch_composition_and_position(
    position: str, others: int
) -> None:
    """The same seeded request, among random companions (greedy, penalised with longer token
    lists that widen the padded block, sorted or not), gives the tokens it gives alone."""
    vocab, steps = 400, 8
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(steps, vocab, generator=gen) * 2

    def target() -> Sequence:
        return make_seq(
            prompt=[5, 6, 7, 5], seed=1234, temperature=0.9, top_k=60, top_p=0.9, min_p=0.02,
            repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2,
        )

    def run(n_others: int) -> list[int]:
        rng = random.Random(n_others * 7 + len(position))
        companions = random_seqs(rng, n_others, vocab)
        at = {"first": 0, "middle": n_others // 2, "last": n_others}[position]
        seqs = companions[:at] + [target()] + companions[at:]
        out = []
        for step in range(steps):
            logits = torch.randn(len(seqs), vocab, generator=gen) * 3
            logits[at] = target_logits[step]
            tokens, _ = sample(logits, seqs)
            out.append(tokens[at])
            for s, t in zip(seqs, tokens, strict=True):
                s.append_token(t)
        return out

    alone = run(0)
    assert run(others) == alone
    assert len(set(alone)) > 1  # drawn, not a fixed argmax


def test_sampled_tokens_respect_top_k_top_p_min_p() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, -1.0])
    assert set(draws(logits, 1, 60, temperature=1.0, top_k=2)) <= {1, 4}
    assert set(draws(logits, 2, 60, temperature=1.0, top_k=1)) == {1}
    assert set(draws(logits, 3, 60, temperature=5.0, top_p=1e-6)) == {1}
    probs = torch.softmax(logits, -1)  # 0.64, 0.24 (idx 4), 0.087 (idx 2), ...
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.3 * probs.max()}
    assert set(draws(logits, 4, 60, temperature=1.0, min_p=0.3)) <= allowed
    assert len(set(draws(logits, 5, 200, temperature=1.0))) >= 4  # no truncation: spread


def test_draws_follow_the_distribution() -> None:
    # inverse CDF over the row: frequencies match the probabilities (4000 draws, 4 sigma)
    logits = torch.tensor([0.0, 1.0, -1.0, 2.0, -30.0])
    probs = torch.softmax(logits, -1).tolist()
    seqs = [make_seq(seed=s, temperature=1.0) for s in range(4000)]
    tokens, _ = sample(logits.expand(4000, -1).contiguous(), seqs)
    counts = collections.Counter(tokens)
    for t, p in enumerate(probs):
        assert abs(counts[t] / 4000 - p) < 4 * math.sqrt(p * (1 - p) / 4000) + 1e-3
    assert counts[4] == 0  # p ~ 1e-14


def test_a_cut_token_is_never_drawn_even_at_the_edges() -> None:
    # zero-probability tokens at the start, the end and between survivors
    logits = torch.tensor([[-100.0, 3.0, -100.0, 3.0, -100.0]]).expand(500, -1).contiguous()
    seqs = [make_seq(seed=s, temperature=1.0, min_p=0.5) for s in range(500)]
    assert set(sample(logits, seqs)[0]) == {1, 3}


def test_inverse_cdf_edges() -> None:
    """u = 0 takes the first token with mass, u just below 1 the last; a zero-mass token is never
    taken, and even u = 1 (which torch.rand never returns) stays inside the vocabulary."""
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.0]]).expand(4, -1).contiguous()
    u = torch.tensor([0.0, 0.4, 1.0 - 2**-24, 1.0])
    assert _draw(probs, u).tolist() == [1, 3, 3, 3]


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5, 0.2])
    cold = draws(logits, 9, 100, temperature=0.05)
    hot = draws(logits, 9, 100, temperature=10.0)
    assert cold.count(1) >= 98
    assert len(set(hot)) == 4


# The smallest temperature that still samples, and penalties at their caps: the edges of what
# `validate` accepts, where dividing by the temperature or multiplying by the penalty is largest.
# Token 2 is the unpenalised maximum by a wide margin, so at this temperature it is the only sane
# outcome. Negative controls, checked by hand: without the float32 upcast in `_penalize`
# (`x = logits`) both penalised float16 cases overflow to inf and NaN (42 / 1e-5 > 65504); with a
# naive softmax (`x.exp() / x.exp().sum()`) all four do; with `GREEDY_BELOW = 0` the
# below-the-threshold cases further down divide by 1e-37 and fail.
EDGE_LOGITS = [0.0, -3.0, 42.0, -1.0]
SAMPLED_EDGES = {
    "smallest sampled temperature, float32 logits in the thousands": (
        {"temperature": GREEDY_BELOW}, torch.float32, 1000.0),
    "smallest sampled temperature, float16 logits": (
        {"temperature": GREEDY_BELOW}, torch.float16, 1.0),
    "penalties at their caps, float16 logits": (
        {"temperature": GREEDY_BELOW, "repetition_penalty": 100.0, "presence_penalty": 2.0,
         "frequency_penalty": 2.0, "logprobs": 2}, torch.float16, 1.0),
    "penalties at the other caps, with top-k, top-p and min-p": (
        {"temperature": GREEDY_BELOW, "repetition_penalty": 100.0, "presence_penalty": -2.0,
         "frequency_penalty": -2.0, "top_k": 3, "top_p": 0.5, "min_p": 1.0}, torch.float16, 1.0),
}


@pytest.mark.parametrize("case", list(SAMPLED_EDGES))
def test_params_at_the_edge_of_the_valid_range_sample_finitely(case: str) -> None:
    params, dtype, scale = SAMPLED_EDGES[case]
    SamplingParams(**params).validate(VOCAB)  # inside the allowed range: no early way out
    logits = (torch.tensor([EDGE_LOGITS]) * scale).to(dtype)
    seqs = [make_seq(prompt=[0, 1, 3], output=[0, 0, 3, 1, 1, 1], seed=s, **params)
            for s in range(8)]
    assert not seqs[0].params.greedy  # the sampled path, temperature division included
    probs = sampling_probs(logits.expand(8, -1).contiguous(), seqs)
    assert torch.isfinite(probs).all(), probs
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 8))
    tokens, lps = sample(logits.expand(8, -1).contiguous(), seqs)
    assert tokens == [2] * 8
    for lp in lps:
        assert lp is None or math.isfinite(lp.logprob)


@pytest.mark.parametrize("temperature", [GREEDY_BELOW / 2, 1e-37, 1e-40])
def test_temperatures_below_the_greedy_threshold_take_the_argmax(temperature: float) -> None:
    """Below GREEDY_BELOW dividing by the temperature would overflow float32 (42 / 1e-37):
    these rows are greedy, argmax of the penalised logits, whatever the other rows do."""
    params = SamplingParams(temperature=temperature)
    params.validate(VOCAB)
    assert params.greedy
    seqs = [make_seq(prompt=[0, 1, 3], temperature=temperature),
            make_seq(prompt=[0, 1, 3], temperature=1.0, repetition_penalty=100.0)]  # a drawn row
    logits = torch.tensor([EDGE_LOGITS] * 2)
    assert sample(logits, seqs)[0][0] == 2
    assert torch.equal(sampling_probs(logits, seqs)[0], torch.tensor([0.0, 0.0, 1.0, 0.0]))


def test_penalties_past_their_caps_are_refused() -> None:
    for params in ({"repetition_penalty": 100.01}, {"repetition_penalty": 1e39},
                   {"presence_penalty": 2.01}, {"frequency_penalty": -2.01}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**params).validate(VOCAB)


def test_vocabularies_past_float32_ids_are_refused() -> None:
    logits = torch.empty(1, 2**24, device="meta")
    with pytest.raises(ValueError, match="2\\^24"):
        sample(logits, [make_seq(temperature=1.0)])


# -- logprobs -----------------------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    {"temperature": 0.0},
    {"temperature": 0.5, "top_k": 3, "repetition_penalty": 1.5, "presence_penalty": 1.0},
    {"temperature": 2.0, "top_p": 0.5},
])
def test_logprobs_are_raw_log_softmax_top_n_sorted(params: dict[str, Any]) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 64, generator=gen) * 2
    seqs = [make_seq(prompt=[3, 4], output=[5], seed=i, logprobs=5, **params) for i in range(2)]
    tokens, lps = sample(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    for row, (tok, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert lp is not None
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[row, tok]), abs=1e-5)
        assert len(lp.top) == 5
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        want = torch.topk(ref[row], 5)
        assert [i for i, _ in lp.top] == want.indices.tolist()
        assert values == pytest.approx(want.values.tolist(), abs=1e-5)
        assert all(v == pytest.approx(float(ref[row, i]), abs=1e-5) for i, v in lp.top)
        assert math.fsum(math.exp(v) for v in ref[row].tolist()) == pytest.approx(1.0)


def test_logprobs_zero_gives_only_the_sampled_token() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tokens, lps = sample(logits, [make_seq(temperature=0.0, logprobs=0)])
    assert tokens == [1]
    assert lps[0] is not None and lps[0].top == []
    assert lps[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))


def test_logprobs_mixed_batch() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    seqs = [make_seq(temperature=0.0), make_seq(temperature=0.0, logprobs=2)]
    tokens, lps = sample(logits, seqs)
    assert tokens == [1, 0]
    assert lps[0] is None
    assert lps[1] is not None and [i for i, _ in lps[1].top] == [0, 2]


def test_logprobs_of_different_widths_in_one_batch() -> None:
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 50, generator=gen)
    seqs = [
        make_seq(temperature=0.0, logprobs=1),
        make_seq(temperature=0.0),
        make_seq(temperature=1.0, logprobs=4, seed=3),
        make_seq(temperature=1.0, logprobs=0, seed=4),
    ]
    tokens, lps = sample(logits, seqs)
    ref = torch.log_softmax(logits, -1)
    assert [None if lp is None else len(lp.top) for lp in lps] == [1, None, 4, 0]
    for row in (0, 2, 3):
        lp = lps[row]
        assert lp is not None and lp.token_id == tokens[row]
        assert lp.logprob == pytest.approx(float(ref[row, tokens[row]]), abs=1e-6)
        n = len(lp.top)
        assert [i for i, _ in lp.top] == torch.topk(ref[row], n).indices.tolist()


# -- host <-> device traffic -----------------------------------------------------------------------

MIXED: list[dict[str, Any]] = [  # the first two rows already cover every feature
    {"temperature": 0.0, "repetition_penalty": 1.3, "logprobs": 2},  # greedy, penalised, lps
    {"temperature": 0.8, "top_p": 0.9, "presence_penalty": 0.5, "logprobs": 0},  # seeded top-p
    {"temperature": 1.0, "top_k": 5, "min_p": 0.1},
    {"temperature": 0.0},
    {"temperature": 0.7, "frequency_penalty": 0.3},
    {"temperature": 1.1, "top_p": 0.95, "logprobs": 4},
]


def mixed_batch(n: int, vocab: int = 2000) -> tuple[torch.Tensor, list[Sequence]]:
    seqs = [
        make_seq(prompt=[i, i + 1, 7], output=[3] * (i % 4), seed=i, **MIXED[i % len(MIXED)])
        for i in range(n)
    ]
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(n)), seqs


def traffic(fn: Any, logits: torch.Tensor, seqs: list[Sequence]) -> HostTraffic:
    with HostTraffic() as counter:
        fn(logits, seqs)
    return counter


@pytest.mark.parametrize("n", [2, 16])
def test_one_sync_and_one_transfer_per_step(n: int) -> None:
    counter = traffic(sample, *mixed_batch(n))
    assert counter.syncs == 1, counter.calls
    assert counter.creations == 1, counter.calls  # the packed parameters: one torch.tensor
    assert counter.transfers == 1, counter.calls  # ... shipped once
    assert counter.calls["sort"] == 1  # the rows needing top-k/top-p share one sort
    assert counter.calls["topk"] == 1  # the logprobs, all rows at once


def test_traffic_does_not_grow_with_the_batch() -> None:
    small, big = traffic(sample, *mixed_batch(2)), traffic(sample, *mixed_batch(16))
    for name in ("syncs", "creations", "transfers"):
        assert getattr(small, name) == getattr(big, name), name
    # the per-row work is host-side only: one 4-byte uniform per drawn row
    assert big.calls["rand"] == sum(not s.params.greedy for s in mixed_batch(16)[1])


def test_rows_without_top_k_or_top_p_pay_no_sort() -> None:
    logits, seqs = mixed_batch(6)
    seqs = [make_seq(temperature=0.9, min_p=0.05, seed=1), make_seq(temperature=0.0, logprobs=1)]
    counter = traffic(sample, logits[:2], seqs)
    assert counter.calls["sort"] == 0
    assert counter.syncs == 1


def test_plain_greedy_ships_nothing() -> None:
    logits = torch.randn(8, 100)
    counter = traffic(sample, logits, [make_seq(temperature=0.0) for _ in range(8)])
    assert (counter.syncs, counter.creations, counter.transfers) == (1, 0, 0)


def test_the_counter_sees_the_per_row_reference_syncs() -> None:
    """Negative control: the counts above are measured, not assumed. The per-row reference
    reads a value back per row (int(), float(), .tolist()) and builds index tensors per row."""
    small = traffic(ref_sample, *mixed_batch(2))
    big = traffic(ref_sample, *mixed_batch(16))
    assert small.syncs > 1
    assert big.syncs > small.syncs  # grows with the batch
    assert big.creations > small.creations > 1
    # and a sync hidden in an otherwise batched call is seen too
    with HostTraffic() as counter:
        torch.randn(3).sum().item()
        torch.randn(3)[[0, 2]]
    assert (counter.syncs, counter.creations) == (1, 1)


# -- SamplingParams validation --------------------------------------------------------------------

VOCAB = 100


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5.0}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
        ({"foo": 1}, "foo"),
        ({"max_tokens": 4, "foo": 1}, "foo"),
    ],
)
def test_invalid_params_name_the_field(values: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams.from_dict(values).validate(VOCAB)
    assert info.value.field == field
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "values",
    [
        {},
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 1.0},
        {"top_p": 1e-9, "top_k": 0, "min_p": 0.0},
        {"repetition_penalty": 1e-3, "presence_penalty": 2, "frequency_penalty": -2},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"logprobs": 0},
        {"logprobs": 20},
        {"stop_token_ids": [0, VOCAB - 1]},
        {"stop": "###"},
        {"stop": ["a", "b"], "ignore_eos": True},
    ],
)
def test_valid_params_pass(values: dict[str, Any]) -> None:
    SamplingParams.from_dict(values).validate(VOCAB)


def test_from_dict_normalises_lists_to_tuples() -> None:
    p = SamplingParams.from_dict({"stop": "x", "stop_token_ids": [3, 4]})
    assert p.stop == ("x",)
    assert p.stop_token_ids == (3, 4)
    p = SamplingParams.from_dict({"stop": ["a", "b"]})
    assert p.stop == ("a", "b")


def test_validate_direct_construction() -> None:
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_p=0.0).validate(VOCAB)
    assert info.value.field == "top_p"
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy  # below 1e-5: argmax, no float32 overflow
    assert not SamplingParams(temperature=1e-4).greedy


def test_invalid_request_error_survives_pickling_with_its_field() -> None:
    import pickle

    err = pickle.loads(pickle.dumps(InvalidRequestError("top_p", "must be in (0, 1]")))
    assert isinstance(err, InvalidRequestError)
    assert (err.field, str(err)) == ("top_p", "top_p: must be in (0, 1]")


def test_bench_sampling_reports_every_mode_and_the_same_draws_with_and_without_the_sort(
        real_checkpoint, monkeypatch):
    """`kvserve bench sampling` at tiny size: every request of every mode runs output_len tokens,
    the sampled modes draw alike (seeded, candidates or full sort) and unlike greedy."""
    from kvserve.bench import sampling
    from kvserve.cli import build_parser
    from kvserve.workers.config import EngineConfig
    from kvserve.workers.engine import LLMEngine

    monkeypatch.setattr(sampling, "LLMEngine",
                        lambda config: LLMEngine(config, checkpoint=real_checkpoint))
    runs: list[dict] = []  # a copy of each run's result, its token ids kept
    real_run = sampling._run
    monkeypatch.setattr(sampling, "_run", lambda *a: runs.append(dict(r := real_run(*a))) or r)
    report = sampling.run_sampling_bench(EngineConfig(kv_cache_memory="256MiB"), output_len=8,
                                         repeats=1, batch_sizes=(3,), progress=False)
    [row] = report["rows"]
    assert row["batch"] == 3 and row["sampled_equals_full_sort"] is True
    for mode in sampling.MODES:
        assert row[mode]["output_tokens"] == 8 * 3, mode
    # the warm-up's runs, then the timed ones, each in MODES order (one round)
    greedy, sampled, full_sort = (r["token_ids"] for r in runs[len(sampling.MODES):])
    assert sampled == full_sort and sampled != greedy
    full = row["sampled_full_sort"]["tok_s"]
    assert row["speedup_vs_full_sort"] == row["sampled"]["tok_s"] / full
    args = build_parser().parse_args(["bench", "sampling", "--top-p", "0.9", "--json"])
    assert (args.top_p, args.top_k, args.batch_sizes, args.json) == (0.9, 0, (1, 32), True)
