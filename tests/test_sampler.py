"""The sampling functions and SamplingParams validation, on small hand-made logits.

Expected values are computed by hand or with plain torch (softmax / log_softmax / argmax), never
with the sampler itself.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from workers.errors import InvalidRequestError
from workers.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    sample,
)
from workers.sampling_params import SamplingParams
from workers.sequence import Sequence

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


def kept(logits: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logits.tolist()) if v != NEG_INF}


# -- top-k --------------------------------------------------------------------------------------

LOGITS = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, -1.0])  # ranks: 1, 4, 2, 3, 0, 5


@pytest.mark.parametrize(
    ("k", "expected"),
    [(1, {1}), (2, {1, 4}), (3, {1, 4, 2}), (5, {1, 4, 2, 3, 0})],
)
def test_top_k_keeps_exactly_k(k: int, expected: set[int]) -> None:
    out = apply_top_k(LOGITS.clone(), k)
    assert kept(out) == expected
    # the survivors are untouched
    for i in expected:
        assert out[i] == LOGITS[i]


@pytest.mark.parametrize("k", [0, -1, 6, 100])
def test_top_k_off(k: int) -> None:
    assert torch.equal(apply_top_k(LOGITS.clone(), k), LOGITS)


def test_top_k_ties_keep_all_tied() -> None:
    out = apply_top_k(torch.tensor([1.0, 3.0, 3.0, 0.0]), 1)
    assert kept(out) == {1, 2}


# -- top-p --------------------------------------------------------------------------------------

# probabilities 0.5, 0.3, 0.15, 0.05, deliberately out of order
PROBS = torch.tensor([0.15, 0.5, 0.05, 0.3])
P_LOGITS = PROBS.log()


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (1e-9, {1}),  # even a tiny p keeps the most likely token
        (0.3, {1}),
        (0.45, {1}),
        (0.55, {1, 3}),  # 0.5 < 0.55: needs the second
        (0.79, {1, 3}),  # 0.8 reaches it
        (0.81, {1, 3, 0}),
        (0.94, {1, 3, 0}),
        (0.96, {1, 3, 0, 2}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_p(p: float, expected: set[int]) -> None:
    out = apply_top_p(P_LOGITS.clone(), p)
    assert kept(out) == expected
    for i in expected:
        assert out[i] == P_LOGITS[i]


def test_top_p_keeps_top_token_when_it_dominates() -> None:
    logits = torch.tensor([0.0, 30.0, 0.0])  # top token has ~all of the mass
    assert kept(apply_top_p(logits, 1e-6)) == {1}
    assert kept(apply_top_p(torch.tensor([2.0, 2.0, 2.0, 9.0]), 0.01)) == {3}


def test_top_p_zero_still_keeps_the_top_token() -> None:
    # p = 0 is rejected by validation, but the function's contract holds at the limit
    assert kept(apply_top_p(P_LOGITS.clone(), 0.0)) == {1}


def test_top_p_one_is_off() -> None:
    assert torch.equal(apply_top_p(P_LOGITS.clone(), 1.0), P_LOGITS)


def test_top_p_matches_a_reference_on_random_logits() -> None:
    gen = torch.Generator().manual_seed(3)
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
        got = kept(apply_top_p(logits.clone(), p))
        # a boundary within float error may include/exclude one token; otherwise exact
        assert got == want or abs(mass - p) < 1e-5


# -- min-p --------------------------------------------------------------------------------------


def test_min_p_threshold_is_relative_to_max_prob() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    out = apply_min_p(probs.clone(), 0.5)  # threshold 0.25
    assert out.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.3])
    out = apply_min_p(probs.clone(), 0.2)  # threshold 0.1
    assert out.tolist() == pytest.approx([0.15, 0.5, 0.0, 0.3])
    out = apply_min_p(probs.clone(), 1.0)  # only the max survives
    assert out.tolist() == pytest.approx([0.0, 0.5, 0.0, 0.0])
    # relative, not absolute: with a flat-ish distribution min_p 0.9 keeps near-max tokens
    flat = torch.tensor([0.26, 0.25, 0.25, 0.24])
    assert (apply_min_p(flat.clone(), 0.9) > 0).tolist() == [True, True, True, True]
    assert (apply_min_p(flat.clone(), 0.95) > 0).tolist() == [True, True, True, False]


def test_min_p_zero_is_off() -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    assert torch.equal(apply_min_p(probs.clone(), 0.0), probs)


# -- penalties ----------------------------------------------------------------------------------


def test_repetition_penalty_over_prompt_and_output() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0, -1.0, 3.0, 0.5])
    seq = make_seq(prompt=[0, 1, 0], output=[2, 2, 3], repetition_penalty=2.0)
    out = apply_penalties(logits.clone(), seq)
    # seen: 0, 1 (prompt), 2, 3 (output) -- each once, however often it was seen
    assert out.tolist() == pytest.approx([1.0, -4.0, 0.5, -2.0, 3.0, 0.5])


def test_repetition_penalty_below_one_rewards() -> None:
    logits = torch.tensor([2.0, -2.0, 1.0])
    seq = make_seq(prompt=[0, 1], repetition_penalty=0.5)
    assert apply_penalties(logits.clone(), seq).tolist() == pytest.approx([4.0, -1.0, 1.0])


def test_presence_and_frequency_from_output_counts_only() -> None:
    logits = torch.zeros(6)
    seq = make_seq(
        prompt=[3, 3, 4], output=[0, 0, 1, 0], presence_penalty=0.5, frequency_penalty=0.25
    )
    out = apply_penalties(logits.clone(), seq)
    # token 0: 3 times -> 0.75 + 0.5; token 1: once -> 0.25 + 0.5; prompt tokens 3, 4 untouched
    assert out.tolist() == pytest.approx([-1.25, -0.75, 0.0, 0.0, 0.0, 0.0])


def test_negative_presence_and_frequency_encourage() -> None:
    seq = make_seq(output=[2, 2], presence_penalty=-1.0, frequency_penalty=-0.5)
    out = apply_penalties(torch.zeros(4), seq)
    assert out.tolist() == pytest.approx([0.0, 0.0, 2.0, 0.0])


def test_presence_without_output_changes_nothing() -> None:
    seq = make_seq(prompt=[1, 2], presence_penalty=2.0, frequency_penalty=2.0)
    assert apply_penalties(torch.ones(4), seq).tolist() == [1.0] * 4


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]])
    seq = make_seq(prompt=[1], temperature=0.0, repetition_penalty=2.0)  # 3 -> 1.5 < 2
    assert sample(logits, [seq])[0] == [2]
    seq = make_seq(output=[1], temperature=0.0, presence_penalty=1.5)  # 3 -> 1.5 < 2
    assert sample(logits, [seq])[0] == [2]
    seq = make_seq(prompt=[1], temperature=0.0, presence_penalty=1.5)  # prompt: no effect
    assert sample(logits, [seq])[0] == [1]


# -- sample(): greedy, seeds, batch independence --------------------------------------------------


def test_temperature_zero_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen)
    seqs = [make_seq(seed=i, temperature=0.0) for i in range(5)]
    tokens, lps = sample(logits, seqs)
    assert tokens == logits.argmax(-1).tolist()
    assert lps == [None] * 5


def test_greedy_ignores_top_k_p_and_generator() -> None:
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0]])
    seq = make_seq(temperature=0.0, top_k=2, top_p=0.1, min_p=0.5)
    state = seq.generator.get_state()
    assert sample(logits, [seq])[0] == [2]
    assert torch.equal(seq.generator.get_state(), state)


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


def test_sampled_tokens_respect_top_k_top_p_min_p() -> None:
    logits = torch.tensor([1.0, 5.0, 3.0, 2.0, 4.0, -1.0])
    assert set(draws(logits, 1, 60, temperature=1.0, top_k=2)) <= {1, 4}
    assert set(draws(logits, 2, 60, temperature=1.0, top_k=1)) == {1}
    assert set(draws(logits, 3, 60, temperature=5.0, top_p=1e-6)) == {1}
    probs = torch.softmax(logits, -1)  # 0.64, 0.24 (idx 4), 0.087 (idx 2), ...
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.3 * probs.max()}
    assert set(draws(logits, 4, 60, temperature=1.0, min_p=0.3)) <= allowed
    assert len(set(draws(logits, 5, 200, temperature=1.0))) >= 4  # no truncation: spread


def test_temperature_sharpens_and_flattens() -> None:
    logits = torch.tensor([0.0, 1.0, 0.5, 0.2])
    cold = draws(logits, 9, 100, temperature=0.05)
    hot = draws(logits, 9, 100, temperature=10.0)
    assert cold.count(1) >= 98
    assert len(set(hot)) == 4


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-37},  # 42 / 1e-37 overflows float32 -> inf -> softmax NaN
        {"temperature": 1e-40},
        {"temperature": 1.0, "repetition_penalty": 1e39},  # 1e39 -> float32 inf
        {"temperature": 0.0, "repetition_penalty": 1e300},  # 0 * inf = NaN wins the argmax
    ],
)
def test_extreme_valid_params_sample_sanely(params: dict[str, Any]) -> None:
    """Either validation rejects the value, or sampling stays finite and sane."""
    try:
        SamplingParams(**params).validate(VOCAB)
    except InvalidRequestError:
        return
    logits = torch.tensor([[0.0, -3.0, 42.0, -1.0]])
    seq = make_seq(prompt=[0, 1, 3], **params)
    # token 2 has 42 against <= 0 and is not penalised: it is the only sane outcome
    assert sample(logits, [seq])[0] == [2]


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
