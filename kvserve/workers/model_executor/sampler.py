"""Per-request sampling from a batch of logits.

Order, for each row: repetition penalty (prompt and output tokens, HF/CTRL style: positive logits
divided, negative multiplied) -> presence and frequency penalties (output tokens, OpenAI style) ->
temperature (0: greedy argmax) -> top-k -> top-p (the most likely token always survives) ->
min-p (relative to the most likely token) -> a draw from the request's own generator, so a seeded
request gets the same tokens whatever else is in the batch. Reported logprobs are those of the raw
model distribution, before any of the above (after a structured-output mask, which the engine
applies to the logits before they reach the sampler).

Why it is batched: on a GPU the step's sampling sits between two forward passes, and a per-row
loop with a full-vocabulary sort and a host copy per row (0.5 MB a row for a 128k vocabulary)
stalls the device once per row. Here a step costs one host->device transfer (every row's
parameters, its uniform draw and, when some row is penalised, the token ids it has seen, packed
in one tensor) and exactly one device->host sync (one float32 tensor carrying the sampled tokens
and the requested logprobs).

Why it stays batch-invariant: each sampled row draws ONE uniform from its own CPU generator (4
bytes, no vocabulary-sized copy) and picks its token by inverse CDF (`searchsorted` over the row's
cumulative probabilities) on the device; every operation is row-wise (no reduction across rows)
and sorts are stable, so a row's token depends only on its logits, its parameters and its draw,
not on which rows share the batch or where the row sits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvserve.workers.core.outputs import TokenLogprobs
from kvserve.workers.core.sampling_params import SamplingParams
from kvserve.workers.core.sequence import Sequence

# Columns of the packed per-row parameters (float32: top-k and token ids are exact below 2^24).
_TEMP, _TOP_K, _TOP_P, _MIN_P, _REP, _PRES, _FREQ = range(7)
_NUM_COLS = 7
_EXACT_IDS = 2**24  # float32 holds every integer below this exactly


@dataclass
class _Plan:
    """The host side of one step: which rows need what, and the packed parameters.

    Row lists are host ints (for slicing the packed tensor and unpacking the result); their
    device twins travel inside the packed tensor, so no index list is ever shipped on its own.
    """

    rows: int
    sampled: list[int]  # rows drawn at random (not greedy), in batch order
    sorted_: list[int]  # positions in `sampled` that need top-k or top-p (one shared sort)
    penalized: list[int]  # rows with a repetition/presence/frequency penalty
    with_logprobs: list[int]  # rows that asked for logprobs
    top_n: int  # the most top logprobs any row asked for
    pen_width: int  # columns of the penalty block: row, prompt length, padded token ids
    host: torch.Tensor  # the packed float32 tensor, on the host; layout in `_unpack`


def sample(
    logits: torch.Tensor, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits: [seqs, vocab] -> one next token per sequence, and its logprobs if asked.

    One host->device transfer and one device->host sync, whatever the batch.
    """
    rows = logits.shape[0]
    if all(_plain_greedy(s.params) for s in seqs):  # the common case: nothing to ship
        return logits.argmax(dim=-1).tolist(), [None] * rows
    plan = _plan(seqs, logits.shape[-1])

    packed = plan.host
    if plan.sampled:  # one uniform per drawn row, from its own generator; greedy rows draw none
        uniforms = torch.stack([torch.rand((), generator=seqs[i].generator) for i in plan.sampled])
        packed = torch.cat([uniforms, packed])
    dev = _unpack(_to_device(packed, logits.device), plan, with_uniforms=bool(plan.sampled))

    x = _penalize(logits, dev)  # x: [rows, vocab]
    tokens = x.argmax(dim=-1)  # [rows]: the greedy choice, replaced below for drawn rows
    if plan.sampled:
        drawn = _draw(_filtered_probs(_sampled_rows(x, dev), dev), dev.uniforms)  # [sampled]
        tokens = drawn if dev.all_sampled else tokens.index_copy(0, dev.sampled, drawn)

    parts = [tokens.float()]  # the one tensor that comes back: [rows + lp * (1 + 2 * top_n)]
    if plan.with_logprobs:
        lp_rows = dev.with_logprobs
        logp = torch.log_softmax(logits.index_select(0, lp_rows).float(), dim=-1)  # [lp, vocab]
        parts.append(logp.gather(1, tokens.index_select(0, lp_rows)[:, None])[:, 0])  # [lp]
        if plan.top_n:
            top = torch.topk(logp, plan.top_n, dim=-1)  # sorted, best first
            parts += [top.indices.float().flatten(), top.values.flatten()]  # [lp * top_n] each
    out = torch.cat(parts).tolist()  # the step's one device->host sync
    return _unpack_result(out, plan, seqs)


def sampling_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [seqs, vocab] -> [seqs, vocab], the distribution each row's token is drawn from.

    The same batched path as `sample`, without the draw (no generator is touched): greedy rows
    get a one-hot at their (penalised) argmax. For tests and debugging.
    """
    plan = _plan(seqs, logits.shape[-1])
    dev = _unpack(_to_device(plan.host, logits.device), plan, with_uniforms=False)
    x = _penalize(logits, dev)  # [rows, vocab]
    probs = torch.zeros_like(x).scatter_(1, x.argmax(dim=-1, keepdim=True), 1.0)
    if plan.sampled:
        drawn = _filtered_probs(_sampled_rows(x, dev), dev)
        drawn = drawn / drawn.sum(dim=-1, keepdim=True)
        probs = drawn if dev.all_sampled else probs.index_copy(0, dev.sampled, drawn)
    return probs


def _plan(seqs: list[Sequence], vocab: int) -> _Plan:
    """Build the packed host tensor with ONE torch.tensor call (no per-row tensors)."""
    if vocab >= _EXACT_IDS:
        raise ValueError(f"vocabulary of {vocab} tokens: ids are packed in float32 (< 2^24)")
    sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
    sorted_ = [j for j, i in enumerate(sampled) if _needs_sort(seqs[i].params, vocab)]
    penalized = [i for i, s in enumerate(seqs) if _penalized(s.params)]
    with_logprobs = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
    top_n = max((seqs[i].params.logprobs or 0 for i in with_logprobs), default=0)
    pen_len = max((seqs[i].num_tokens for i in penalized), default=0)

    flat: list[float] = []
    for s in seqs:
        p = s.params
        flat += [
            1.0 if p.greedy else p.temperature,  # greedy rows never divide: 1.0 is a placeholder
            float(p.top_k if _top_k_on(p, vocab) else vocab),
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.presence_penalty,
            p.frequency_penalty,
        ]
    flat += sampled
    flat += sorted_
    for i in penalized:  # [row, prompt length, prompt + output ids padded with `vocab`]
        s = seqs[i]
        flat += [i, s.num_prompt_tokens, *s.token_ids] + [vocab] * (pen_len - s.num_tokens)
    flat += with_logprobs
    host = torch.tensor(flat, dtype=torch.float32)
    return _Plan(len(seqs), sampled, sorted_, penalized, with_logprobs, top_n, 2 + pen_len, host)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The step's one host->device transfer.

    A plain copy from pageable memory makes PyTorch synchronise the stream (it waits for the
    forward pass queued before it); from pinned memory, non-blocking, it queues behind it instead.
    The caching host allocator keeps the pinned buffer until the copy has run.
    """
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


@dataclass
class _Device:
    """The step's parameters on the logits' device: views into the one transferred tensor."""

    uniforms: torch.Tensor  # [sampled] float32 in [0, 1) (empty without uniforms)
    params: torch.Tensor  # [rows, cols] float32
    sampled: torch.Tensor  # [sampled] int64 rows
    sorted_: torch.Tensor  # [sorted] int64 positions within the sampled rows
    penalty: torch.Tensor  # [penalized, 2 + len] float32: row, prompt length, padded ids
    with_logprobs: torch.Tensor  # [lp] int64 rows
    all_sampled: bool  # every row is drawn: no gather/scatter of the sampled rows


def _unpack(packed: torch.Tensor, plan: _Plan, with_uniforms: bool) -> _Device:
    """packed: [uniforms? + rows * cols + sampled + sorted + penalty block + lp] on the device."""
    sizes = [
        len(plan.sampled) if with_uniforms else 0,
        plan.rows * _NUM_COLS,
        len(plan.sampled),
        len(plan.sorted_),
        len(plan.penalized) * plan.pen_width,
        len(plan.with_logprobs),
    ]
    u, params, sampled, sorted_, penalty, lp = torch.split(packed, sizes)
    return _Device(
        uniforms=u,
        params=params.view(plan.rows, _NUM_COLS),
        sampled=sampled.long(),
        sorted_=sorted_.long(),
        penalty=penalty.view(len(plan.penalized), plan.pen_width),
        with_logprobs=lp.long(),
        all_sampled=len(plan.sampled) == plan.rows,
    )


def _unpack_result(
    out: list[float], plan: _Plan, seqs: list[Sequence]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """out: [rows tokens, lp token logprobs, lp * top_n ids, lp * top_n values] as host floats."""
    rows, n, m = plan.rows, plan.top_n, len(plan.with_logprobs)
    tokens = [int(t) for t in out[:rows]]
    logprobs: list[TokenLogprobs | None] = [None] * rows
    token_lp = out[rows : rows + m]
    ids = out[rows + m : rows + m + m * n]
    values = out[rows + m + m * n :]
    for j, i in enumerate(plan.with_logprobs):
        want = seqs[i].params.logprobs or 0  # rows asking fewer than top_n take a prefix
        top = [(int(ids[j * n + k]), values[j * n + k]) for k in range(want)]
        logprobs[i] = TokenLogprobs(tokens[i], token_lp[j], top)
    return tokens, logprobs


def _plain_greedy(p: SamplingParams) -> bool:
    return p.greedy and not _penalized(p) and p.logprobs is None


def _penalized(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _top_k_on(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab


def _needs_sort(p: SamplingParams, vocab: int) -> bool:
    return _top_k_on(p, vocab) or p.top_p < 1.0


def _penalize(logits: torch.Tensor, dev: _Device) -> torch.Tensor:
    """logits: [rows, vocab] -> float32 [rows, vocab] with the penalised rows penalised.

    Only the penalised rows are touched; the input is never modified.
    """
    x = logits.float()
    if not dev.penalty.shape[0]:
        return x
    pen = dev.penalty  # [pen, 2 + len]
    rows = pen[:, 0].long()  # [pen]
    sub = x.index_select(0, rows)  # [pen, vocab]
    params = dev.params.index_select(0, rows)  # [pen, cols]
    n, vocab = sub.shape
    ids = pen[:, 2:].long()  # [pen, len]; padding is `vocab`, a spare column dropped below
    is_output = torch.arange(ids.shape[1], device=x.device)[None, :] >= pen[:, 1:2]  # [pen, len]
    counts = torch.zeros(n, vocab + 1, device=x.device).scatter_add_(
        1, ids, is_output.float()
    )[:, :vocab]  # [pen, vocab]: times each token was generated
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=x.device).scatter_(
        1, ids, True
    )[:, :vocab]  # [pen, vocab]: in the prompt or the output, however often
    rep = params[:, _REP : _REP + 1]  # [pen, 1]; 1.0 leaves every logit as it is
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq, pres = params[:, _FREQ : _FREQ + 1], params[:, _PRES : _PRES + 1]  # [pen, 1] each
    sub = sub - (freq * counts + pres * (counts > 0).float())
    return x.index_copy(0, rows, sub)


def _sampled_rows(x: torch.Tensor, dev: _Device) -> torch.Tensor:
    """x: [rows, vocab] -> [sampled, vocab]."""
    return x if dev.all_sampled else x.index_select(0, dev.sampled)


def _filtered_probs(x: torch.Tensor, dev: _Device) -> torch.Tensor:
    """x: [sampled, vocab] penalised logits -> unnormalised probabilities [sampled, vocab] after
    temperature, top-k, top-p and min-p, zero where cut."""
    params = dev.params if dev.all_sampled else dev.params.index_select(0, dev.sampled)
    x = x / params[:, _TEMP : _TEMP + 1]  # [sampled, vocab]
    if dev.sorted_.shape[0]:  # only these rows pay for the (one, shared, stable) sort
        sub = x.index_select(0, dev.sorted_)  # [sorted, vocab]
        sub = _top_k_top_p(sub, params.index_select(0, dev.sorted_))
        x = x.index_copy(0, dev.sorted_, sub)
    probs = torch.softmax(x, dim=-1)  # [sampled, vocab]
    threshold = params[:, _MIN_P : _MIN_P + 1] * probs.amax(dim=-1, keepdim=True)  # min-p 0: off
    return probs.masked_fill(probs < threshold, 0.0)


def _top_k_top_p(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """x: [n, vocab] -> x with the tokens outside top-k, then outside top-p, at -inf.

    Top-k keeps every token tied with the k-th; top-p keeps the smallest prefix of the (top-k
    filtered) distribution whose mass reaches p, and always the most likely token; ties are
    ordered by token id. On a CPU with a large vocabulary, rows are first tried on their
    `_CANDIDATES` most likely tokens (`_top_k_top_p_candidates`); a full-vocabulary sort costs
    ~3.5 ms a row of 49,152 on one core, which at 32 rows is longer than the decode step.
    """
    if x.is_cpu and x.shape[-1] >= _CANDIDATES_FROM_VOCAB:
        return _top_k_top_p_candidates(x, params, _CANDIDATES)
    return _top_k_top_p_sorted(x, params)


# A CPU row's top-k/top-p is tried on this many of its most likely tokens, where the vocabulary
# is at least _CANDIDATES_FROM_VOCAB (below it, a partial sort saves little over the full one)
_CANDIDATES = 1024
_CANDIDATES_FROM_VOCAB = 8 * _CANDIDATES


@contextlib.contextmanager
def full_vocabulary_sort() -> Iterator[None]:
    """Within the block, top-k/top-p sort every row's whole vocabulary on every device: the
    baseline `kvserve bench sampling` compares the candidates against."""
    global _CANDIDATES_FROM_VOCAB
    before, _CANDIDATES_FROM_VOCAB = _CANDIDATES_FROM_VOCAB, _EXACT_IDS
    try:
        yield
    finally:
        _CANDIDATES_FROM_VOCAB = before


def _top_k_top_p_candidates(x: torch.Tensor, params: torch.Tensor, m: int) -> torch.Tensor:
    """`_top_k_top_p` decided on each row's m most likely tokens where they decide it, by the
    sort for the other rows.

    The kept tokens are a prefix of the stable order, so a row is decided by its first m
    candidates (`torch.topk`, put back in the stable order: ties by id) when the kept prefix
    ends before the candidates' last value: every token past that is cut in any tie order.
    The probabilities are the sort's top-k-masked softmax over the whole row (summed in
    vocabulary order rather than sorted order), so top-p sees the same mass. A row is sent to
    the sort when its top-k is between m and the vocabulary (its k-th value is not among the
    candidates) or its kept prefix reaches the last candidate value (a flat distribution, or
    ties there). Each row's path depends on that row alone, so a row's result does not depend
    on the batch. On a CPU the one flag read back costs no device sync.
    """
    vocab = x.shape[-1]
    k = params[:, _TOP_K].long()  # [n]; k = vocab when off
    top_p = params[:, _TOP_P : _TOP_P + 1]  # [n, 1]
    vals, ids = torch.topk(x, m, dim=-1, sorted=False)  # [n, m] each: the m largest, any order
    ids, by_id = ids.sort(dim=-1)
    vals, order = vals.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    ids = ids.gather(1, order)  # [n, m]: the candidates in the stable sort's order
    kth = vals.gather(1, (k.clamp(max=m) - 1)[:, None])  # [n, 1]
    kth = torch.where(k[:, None] >= vocab, torch.full_like(kth, float("-inf")), kth)
    probs = torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1).gather(1, ids)
    before = torch.cumsum(probs, dim=-1) - probs  # [n, m]: mass strictly ahead of each
    keep = (vals >= kth) & ~((before >= top_p) & (top_p < 1.0))  # a prefix of the candidates
    keep[:, 0] = True  # always the most likely token
    kept = keep.sum(dim=-1)  # [n]
    last = vals.gather(1, (kept - 1)[:, None])[:, 0]  # the value of the last token kept
    decided = ((k <= m) | (k >= vocab)) & (kept < m) & (last > vals[:, -1])  # [n]
    out = x.masked_fill(~torch.zeros_like(x, dtype=torch.bool).scatter_(1, ids, keep),
                        float("-inf"))
    if not bool(decided.all()):
        rows = (~decided).nonzero()[:, 0]
        out = out.index_copy(0, rows, _top_k_top_p_sorted(x.index_select(0, rows),
                                                           params.index_select(0, rows)))
    return out


def _top_k_top_p_sorted(x: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """`_top_k_top_p` by one stable sort of the whole vocabulary.

    Top-k keeps every token tied with the k-th; top-p keeps the smallest prefix of the (top-k
    filtered) distribution whose mass reaches p, and always the most likely token.
    """
    ordered, order = torch.sort(x, dim=-1, descending=True, stable=True)  # [n, vocab] each
    k = params[:, _TOP_K : _TOP_K + 1].long()  # [n, 1]; k = vocab when off
    kth = ordered.gather(1, k - 1)  # [n, 1]
    drop = ordered < kth  # [n, vocab]: outside top-k (ties with the k-th kept)
    probs = torch.softmax(ordered.masked_fill(drop, float("-inf")), dim=-1)
    before = torch.cumsum(probs, dim=-1) - probs  # mass strictly ahead of each token
    top_p = params[:, _TOP_P : _TOP_P + 1]
    drop_p = (before >= top_p) & (top_p < 1.0)  # p = 1 is off, whatever the rounding of before
    drop_p[:, 0] = False  # always keep the most likely token
    drop = torch.empty_like(drop).scatter_(1, order, drop | drop_p)  # back to vocabulary order
    return x.masked_fill(drop, float("-inf"))


def _draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """probs: [n, vocab] unnormalised, u: [n] uniforms in [0, 1) -> [n] tokens by inverse CDF.

    The first token whose cumulative mass exceeds u * total: a zero-probability token never
    has its cumulative mass exceed anything its predecessor's did not, so it is never chosen.
    """
    cdf = torch.cumsum(probs, dim=-1)  # [n, vocab]
    total = cdf[:, -1:]  # [n, 1]
    # u < 1 keeps u * total below total in IEEE float32; should a kernel round it up to total,
    # the largest float below total still picks a real token instead of running off the end
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]
