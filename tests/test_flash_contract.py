"""The flash_attn backend's code path on a CPU: its kernels replaced by pure-torch references
of their documented contracts (attention.flash_reference), against the torch backend.

What this covers: every argument the backend derives from a step's metadata (cu_seqlens,
block tables, lengths, maxima, causal alignment over a cached prefix, GQA), for both kernel
providers. What it cannot: the kernels themselves, checked on a GPU by
`flash_checks.compare_with_reference` (tests/test_flash_backend.py, marked gpu).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvserve.workers.builder import resolve_block_size
from kvserve.workers.model_executor.attention import TorchAttention, resolve_backend_name
from kvserve.workers.model_executor.attention import flash_reference as ref
from kvserve.workers.model_executor.attention.flash_backend import (
    FLASH_ATTN,
    FLASH_BLOCK_MULTIPLE,
    PROVIDERS,
    TORCH_VARLEN,
    FlashAttention,
    FlashAttnProvider,
    TorchVarlenProvider,
    default_provider_name,
    required_block_multiple,
)
from kvserve.workers.model_executor.attention.flash_checks import (
    compare_with_reference,
    probe_batch_invariance,
    probe_block_sizes,
    random_step,
    reference_provider,
    run_all,
    use_backend,
)
from tests.helpers import assert_engine_idle, output_ids

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (decode context lengths, prefill (q_len, context_len)); lengths cross 16-token blocks, and
# one sequence of each mixed batch crosses a 256-token block
CPU_CASES = {
    "decodes": ((1, 17, 40, 16), ()),
    "prefills_fresh": ((), ((16, 16), (7, 7), (33, 33))),
    "prefills_over_cached_prefix": ((), ((5, 40), (7, 23), (16, 48), (1, 9))),
    "mixed": ((5, 300, 33), ((9, 9), (20, 280), (12, 29), (3, 3))),
}
HEADS = [(9, 3), (4, 4), (14, 2)]  # SmolLM2's 3:1, no GQA, Qwen2-0.5B's 7:1
TOLERANCE = {torch.float32: {"atol": 1e-5, "rtol": 1e-5},
             torch.bfloat16: {"atol": 3e-2, "rtol": 2e-2}}


def _flash(provider: str, **limits) -> FlashAttention:
    return FlashAttention(reference_provider(provider, **limits))


def _step(case: str = "mixed", **kwargs):
    decodes, prefills = CPU_CASES[case]
    return random_step(decodes, prefills, **kwargs)


# -- the backend against the torch backend --------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS, ids=[f"{h}q{k}kv" for h, k in HEADS])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_backend_equals_torch_backend(provider, heads, kv_heads, block_size, dtype):
    backend = _flash(provider)
    for case in CPU_CASES:
        step = _step(case, heads=heads, kv_heads=kv_heads, block_size=block_size, dtype=dtype,
                     seed=heads + block_size)
        got = step.run(backend)
        assert got.dtype == dtype and got.shape == step.q.shape
        torch.testing.assert_close(got, step.run(TorchAttention()), **TOLERANCE[dtype],
                                   msg=lambda m, case=case: f"{case}: {m}")


@pytest.mark.parametrize("window", [1, 7, 100])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_a_sliding_window_equals_the_torch_backends(provider, window):
    """A sliding-window layer through each provider's call (`window_size=(window - 1, 0)`,
    the reference kernels' window mask) against the torch backend's own windowed masks: two
    implementations of transformers' rule. Negative control: full attention differs."""
    backend = _flash(provider)
    for case in CPU_CASES:
        step = _step(case, heads=9, kv_heads=3, seed=window)
        got = step.run(backend, window=window)
        torch.testing.assert_close(got, step.run(TorchAttention(), window=window),
                                   **TOLERANCE[torch.float32],
                                   msg=lambda m, case=case: f"{case}: {m}")
        if max(step.meta.max_decode_context, step.meta.max_prefill_k) > window:
            assert not torch.allclose(got, step.run(backend), atol=1e-4), case


@pytest.mark.parametrize("window", [0, 7])
def test_a_soft_cap_equals_the_torch_backends_and_torch_varlen_refuses_it(window):
    """Gemma 2's soft-capped scores through flash-attn's `softcap` (the reference kernel's cap)
    against the torch backend's eager steps; torch's varlen_attn has no softcap argument, so
    the backend over it refuses a capped layer rather than ignore the cap. Negative control:
    without the cap the output differs."""
    backend = _flash(FLASH_ATTN)
    for case in CPU_CASES:
        step = _step(case, heads=9, kv_heads=3, seed=5)
        got = step.run(backend, window=window, softcap=0.5)
        torch.testing.assert_close(got, step.run(TorchAttention(), window=window, softcap=0.5),
                                   **TOLERANCE[torch.float32],
                                   msg=lambda m, case=case: f"{case}: {m}")
        assert not torch.allclose(got, step.run(backend, window=window), atol=1e-4), case
    with pytest.raises(ValueError, match="soft-capping"):
        _step("mixed").run(_flash(TORCH_VARLEN), softcap=0.5)


def test_the_step_writes_the_cache_like_the_torch_backend():
    step = _step()
    caches = {}
    for name, backend in (("flash", _flash(FLASH_ATTN)), ("torch", TorchAttention())):
        k_cache, v_cache = step.k_cache.clone(), step.v_cache.clone()
        backend(step.q, step.k, step.v, k_cache, v_cache, step.meta, step.scale)
        caches[name] = (k_cache, v_cache)
    assert all(torch.equal(a, b) for a, b in zip(caches["flash"], caches["torch"], strict=True))


class _Recording(FlashAttention):
    """Notes each call's batch shape: (decodes, [(q_len, context_len) per prefill chunk])."""

    def __init__(self, provider) -> None:
        super().__init__(provider)
        self.steps: list[tuple[int, list[tuple[int, int]]]] = []

    def __call__(self, q, k, v, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
        self.steps.append((meta.num_decodes, [(s.q_len, s.context_len) for s in meta.prefills]))
        return super().__call__(q, k, v, k_cache, v_cache, meta, scale, window, softcap)


# a tiny random model attends almost uniformly at its default init (0.02), so attention bugs
# barely move its tokens; a wider init sharpens attention (fp32). bf16 stays nearer the default,
# where the two backends' roundings leave greedy choices alone (0.016 logprob apart at most)
ENGINE_INIT = {"float32": 0.3, "bfloat16": 0.05}
ENGINE_LOGPROB_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}


def _engine_run(make_tiny_engine, dtype: str, backend: FlashAttention | None):
    """Greedy token ids and their logprobs, per request: chunked prefill (a 32-token budget),
    a chunk over a prefix-cache hit, decodes batched beside other prompts' chunks."""
    shared = list(range(500, 540))  # 40 tokens: two full blocks shared by two prompts
    prompts = [list(range(3, 8)), shared + [7, 8, 9], list(range(100, 170)), shared + [11]]
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "logprobs": 0}
    engine = make_tiny_engine(
        block_size=16, max_num_batched_tokens=32, enable_prefix_caching=True, dtype=dtype,
        attention_backend="torch", checkpoint_kwargs={"initializer_range": ENGINE_INIT[dtype]})
    if backend is not None:
        use_backend(engine, backend)
        assert engine.info.attention_backend == "flash_attn"
    requests = [{"prompt_token_ids": p, "params": params} for p in prompts]
    # the last prompt arrives after the second has filled the cache: a prefix hit
    streams = engine.generate_all(requests[:3])
    streams |= engine.generate_all(requests[3:])
    assert_engine_idle(engine)
    ids = [output_ids(s) for s in streams.values()]
    logprobs = torch.tensor([lp.logprob for s in streams.values() for o in s
                             for lp in o.logprobs])
    return ids, logprobs


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_engine_greedy_outputs_equal_the_torch_backends(make_tiny_engine, provider, dtype):
    flash = _Recording(reference_provider(provider))
    ids, logprobs = _engine_run(make_tiny_engine, dtype, flash)
    expected_ids, expected_logprobs = _engine_run(make_tiny_engine, dtype, None)
    assert ids == expected_ids
    torch.testing.assert_close(logprobs, expected_logprobs, rtol=0,
                               atol=ENGINE_LOGPROB_ATOL[dtype])
    chunks = [c for _, prefills in flash.steps for c in prefills]
    assert (9, 41) in chunks, "the last prompt's chunk over its 32 cached tokens"
    assert any(q < ctx for q, ctx in chunks if (q, ctx) != (9, 41)), "a chunked prompt"
    assert any(nd and prefills for nd, prefills in flash.steps), "decodes beside chunks"


def test_engine_comparison_catches_a_buggy_backend(make_tiny_engine):
    """The negative control of the test above: prefill chunks attending non-causally."""
    buggy = FlashAttention(_reference_like(_NonCausalPrefill, FLASH_ATTN))
    ids, logprobs = _engine_run(make_tiny_engine, "float32", buggy)
    expected_ids, expected_logprobs = _engine_run(make_tiny_engine, "float32", None)
    assert ids != expected_ids
    assert (logprobs - expected_logprobs).abs().max() > 0.1


# -- the references refuse what the kernels refuse ------------------------------------------


def _prefill_args(dtype=torch.bfloat16, block_size=16):
    """flash_attn_varlen_func's arguments for a step's prefill chunks, as the backend builds."""
    step = _step("prefills_over_cached_prefix", dtype=dtype, block_size=block_size)
    m = step.meta
    return dict(q=step.q, k=step.k_cache, v=step.v_cache, cu_seqlens_q=m.cu_seqlens_q,
                cu_seqlens_k=m.cu_seqlens_k, max_seqlen_q=m.max_prefill_q,
                max_seqlen_k=m.max_prefill_k, causal=True, block_table=m.prefill_block_tables)


def _decode_args(dtype=torch.bfloat16, block_size=16):
    step = _step("decodes", dtype=dtype, block_size=block_size)
    m = step.meta
    return dict(q=step.q.unsqueeze(1), k_cache=step.k_cache, v_cache=step.v_cache,
                cache_seqlens=m.decode_context_lens, block_table=m.decode_block_tables,
                causal=True)


def _varlen_args(dtype=torch.bfloat16, block_size=16):
    a = _prefill_args(dtype, block_size)
    return dict(query=a["q"], key=a["k"], value=a["v"], cu_seq_q=a["cu_seqlens_q"],
                cu_seq_k=a["cu_seqlens_k"], max_q=a["max_seqlen_q"], max_k=a["max_seqlen_k"],
                window_size=(-1, 0), enable_gqa=True, seqused_k=torch.diff(a["cu_seqlens_k"]),
                block_table=a["block_table"])


def _int64(t):
    return t.long()


def _shift_last(t):
    t = t.clone()
    t[-1] += 1
    return t


def _decrease(t):
    t = t.clone()
    t[1] = t[2] + 1
    return t


WRONG = {  # name -> (kernel, argument, change, error message)
    "varlen cu_seqlens_q int64": ("varlen", "cu_seqlens_q", _int64, "int32"),
    "varlen cu_seqlens_k int64": ("varlen", "cu_seqlens_k", _int64, "int32"),
    "varlen block_table int64": ("varlen", "block_table", _int64, "int32"),
    "varlen cu_seqlens_q past q's rows": ("varlen", "cu_seqlens_q", _shift_last, "rows"),
    "varlen cu_seqlens_k decreasing": ("varlen", "cu_seqlens_k", _decrease, "non-decreasing"),
    "varlen cu_seqlens_k one short": ("varlen", "cu_seqlens_k", lambda t: t[:-1], "shape"),
    "varlen max_seqlen_q too small": ("varlen", "max_seqlen_q", lambda n: n - 1, "longest"),
    "varlen max_seqlen_k too small": ("varlen", "max_seqlen_k", lambda n: n - 1, "longest"),
    "varlen max_seqlen_q a tensor": ("varlen", "max_seqlen_q", torch.tensor, "Python int"),
    "varlen q last dim strided": ("varlen", "q", lambda t: t.transpose(1, 2).contiguous()
                                  .transpose(1, 2), "contiguous last"),
    "varlen q 4-d": ("varlen", "q", lambda t: t[None], "total_q"),
    "varlen k/v dtype differs": ("varlen", "k", lambda t: t.half(), "same dtype"),
    "varlen block_table row short": ("varlen", "block_table", lambda t: t[:, :1], "pages"),
    "varlen block_table out of pool": ("varlen", "block_table", lambda t: t + 1000, "outside"),
    "varlen block_table rows missing": ("varlen", "block_table", lambda t: t[:2], "batch_size"),
    "kvcache cache_seqlens int64": ("kvcache", "cache_seqlens", _int64, "int32"),
    "kvcache cache_seqlens an int": ("kvcache", "cache_seqlens", lambda t: 5, "int32 tensor"),
    "kvcache block_table int64": ("kvcache", "block_table", _int64, "int32"),
    "kvcache q 3-d": ("kvcache", "q", lambda t: t[:, 0], "seqlen_q"),
    "kvcache too long for its table": ("kvcache", "cache_seqlens", lambda t: t + 64, "pages"),
    "torch seqused_k int64": ("torch", "seqused_k", _int64, "int32"),
    "torch seqused_k missing": ("torch", "seqused_k", lambda t: None, "requires seqused_k"),
    "torch seqused_k past cu_seq_k": ("torch", "seqused_k", lambda t: t + 1, "within"),
    "torch cu_seq_k int64": ("torch", "cu_seq_k", _int64, "int32"),
    "torch GQA without enable_gqa": ("torch", "enable_gqa", lambda b: False, "enable_gqa"),
}
KERNELS = {
    "varlen": (ref.flash_attn_varlen_func, _prefill_args),
    "kvcache": (ref.flash_attn_with_kvcache, _decode_args),
    "torch": (ref.varlen_attn, _varlen_args),
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_references_refuse_what_the_kernels_refuse(wrong):
    kernel_name, arg, change, message = WRONG[wrong]
    kernel, make_args = KERNELS[kernel_name]
    args = make_args()
    kernel(**args, page_multiple=1)  # as built: accepted
    args[arg] = change(args[arg])
    with pytest.raises(ref.ContractError, match=message):
        kernel(**args, page_multiple=1)


@pytest.mark.parametrize("kernel_name", list(KERNELS))
def test_references_keep_the_kernels_dtype_and_page_limits(kernel_name):
    kernel, make_args = KERNELS[kernel_name]
    assert kernel(**make_args(block_size=256)).dtype == torch.bfloat16  # the kernel's own limits
    with pytest.raises(ref.ContractError, match="divisible by 256"):
        kernel(**make_args(block_size=16))
    with pytest.raises(ref.ContractError, match="float16, bfloat16"):
        kernel(**make_args(dtype=torch.float32, block_size=256))


def test_reference_causal_is_aligned_bottom_right():
    """Two queries over five keys: the first sees keys 0..3, the last all five."""
    assert ref.window_mask(2, 5, (-1, 0)).tolist() == [[True, True, True, True, False],
                                                       [True] * 5]
    assert ref.window_mask(2, 5, (1, 0)).tolist() == [[False, False, True, True, False],
                                                      [False, False, False, True, True]]
    q, k = torch.randn(3, 2, 8), torch.randn(5, 1, 8)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32)
    out = ref.flash_attn_varlen_func(q, k, k, cu_q, cu_k, 3, 5, causal=True,
                                     dtypes=ref.ALL_DTYPES)
    alone = ref.flash_attn_varlen_func(q[2:], k, k, cu_q.clamp(max=1), cu_k, 1, 5, causal=True,
                                       dtypes=ref.ALL_DTYPES)
    torch.testing.assert_close(out[2:], alone)  # the last query sees every key


# -- negative controls: a wrong backend fails the contract test -----------------------------


def _swap_rows(t):
    return t[[1, 0, *range(2, t.shape[0])]].contiguous()


def _plus_one(t):
    return t + 1


METADATA_BUGS = {  # what a backend could get wrong about the step, as wrong metadata
    "cu_seqlens_k shifted": lambda m: {"cu_seqlens_k": _shift_interior(m.cu_seqlens_k)},
    "cu_seqlens_q shifted": lambda m: {"cu_seqlens_q": _shift_interior(m.cu_seqlens_q)},
    "prefill block_table rows swapped":
        lambda m: {"prefill_block_tables": _swap_rows(m.prefill_block_tables)},
    "decode block_table rows swapped":
        lambda m: {"decode_block_tables": _swap_rows(m.decode_block_tables)},
    "decode lengths off by one":
        lambda m: {"decode_context_lens": m.decode_context_lens - 1},
    "decode lengths int64": lambda m: {"decode_context_lens": m.decode_context_lens.long()},
    "prefill block_table int64":
        lambda m: {"prefill_block_tables": m.prefill_block_tables.long()},
    "cu_seqlens_k int64": lambda m: {"cu_seqlens_k": m.cu_seqlens_k.long()},
    "max_prefill_q short": lambda m: {"max_prefill_q": m.max_prefill_q - 1},
}


def _shift_interior(cu):
    """Move the boundary between the first two sequences by one token."""
    cu = cu.clone()
    cu[1] += 1
    return cu


def _caught(step, backend, meta) -> str | None:
    """How the contract test catches `backend` on `meta`: 'raised', 'mismatch', or None."""
    try:
        got = step.run(backend, meta)
    except (ref.ContractError, ValueError, RuntimeError, IndexError):
        return "raised"
    expected = step.run(TorchAttention())
    return None if torch.allclose(got, expected, **TOLERANCE[torch.float32]) else "mismatch"


@pytest.mark.parametrize("bug", list(METADATA_BUGS))
@pytest.mark.parametrize("provider", PROVIDERS)
def test_wrong_metadata_is_caught(provider, bug):
    step = _step("mixed", heads=9, kv_heads=3)
    backend = _flash(provider)
    assert _caught(step, backend, step.meta) is None  # the control: right metadata passes
    wrong = dataclasses.replace(step.meta, **METADATA_BUGS[bug](step.meta))
    assert _caught(step, backend, wrong) is not None


class _NonCausalPrefill(FlashAttnProvider):
    def prefill(self, q, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_prefill_q,
                            max_seqlen_k=meta.max_prefill_k, softmax_scale=scale, causal=False,
                            block_table=meta.prefill_block_tables)


class _QueryLengthsAsKeys(TorchVarlenProvider):
    """Forgets that a chunk over a cached prefix has more keys than queries."""

    def prefill(self, q, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
        return self._varlen(q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_q,
                            meta.max_prefill_q, meta.max_prefill_q, scale=scale,
                            window_size=(-1, 0), enable_gqa=True,
                            seqused_k=torch.diff(meta.cu_seqlens_q),
                            block_table=meta.prefill_block_tables)


class _DefaultScale(FlashAttnProvider):
    def decode(self, q, k_cache, v_cache, meta, scale, window=0, softcap=0.0):
        return super().decode(q, k_cache, v_cache, meta, None, window, softcap)


def _reference_like(cls, base: str):
    """`cls` (a buggy provider) with the reference kernels of provider `base`."""
    good = reference_provider(base)
    bad = cls.__new__(cls)
    bad.__dict__.update(good.__dict__)
    return bad


@pytest.mark.parametrize(("bug", "base"), [(_NonCausalPrefill, FLASH_ATTN),
                                           (_QueryLengthsAsKeys, TORCH_VARLEN),
                                           (_DefaultScale, FLASH_ATTN)])
def test_a_buggy_backend_fails_the_contract_test(bug, base):
    step = _step("mixed", heads=9, kv_heads=3)
    step.scale = 0.3  # not head_dim**-0.5, so that a dropped scale shows
    assert _caught(step, _flash(base), step.meta) is None
    assert _caught(step, FlashAttention(_reference_like(bug, base)), step.meta) == "mismatch"


# -- provider selection, block sizes, dtypes ------------------------------------------------


def test_every_provider_needs_blocks_of_256():
    assert {p: required_block_multiple(p) for p in PROVIDERS} == {p: 256 for p in PROVIDERS}
    assert FLASH_BLOCK_MULTIPLE == 256
    with pytest.raises(ValueError, match="unknown flash provider"):
        required_block_multiple("xformers")


def test_engine_block_size_and_dtype_follow_the_provider_rule():
    """Checked when the engine is built: a replica with a wrong setting does not start."""
    flash = FlashAttention(reference_provider(TORCH_VARLEN, dtypes=ref.KERNEL_DTYPES,
                                              page_multiple=256))
    bf16 = torch.bfloat16
    assert resolve_block_size(None, flash, bf16) == 256
    assert resolve_block_size(512, flash, bf16) == 512
    with pytest.raises(ValueError, match="multiple of 256"):
        resolve_block_size(16, flash, bf16)
    with pytest.raises(ValueError, match="not dtype float32"):
        resolve_block_size(None, flash, torch.float32)
    assert resolve_block_size(None, TorchAttention(), torch.float32) == 16


@pytest.mark.skipif(default_provider_name() is not None, reason="a flash provider is here")
def test_without_a_provider_the_backend_names_what_is_missing():
    with pytest.raises(RuntimeError, match="flash-attn package or torch>=2.13's") as err:
        FlashAttention()
    assert torch.__version__ in str(err.value)


def test_auto_on_cuda_prefers_flash_attn_then_triton_then_varlen_then_sdpa(monkeypatch):
    """flash-attn's own package first; else kvserve's triton kernels (any block size, CUDA
    graphs); else torch's varlen FlashAttention; SDPA (the torch backend) last."""
    import kvserve.workers.model_executor.attention as attention

    cuda = torch.device("cuda")
    installed = {FLASH_ATTN: True, "triton": True, TORCH_VARLEN: True}
    monkeypatch.setattr(attention, "provider_missing",
                        lambda name: None if installed[name] else "absent")
    monkeypatch.setattr(attention, "triton_missing",
                        lambda device: None if installed["triton"] else "absent")
    monkeypatch.setattr(attention, "default_provider_name",
                        lambda: next((p for p in PROVIDERS if installed[p]), None))
    expected = ["flash_attn", "triton", "flash_attn", "torch"]
    for name, wanted in zip([None, FLASH_ATTN, "triton", TORCH_VARLEN], expected, strict=True):
        if name:
            installed[name] = False
        assert resolve_backend_name("auto", cuda) == wanted, name
    assert resolve_backend_name("auto", torch.device("cpu")) == "cpu"
    with pytest.raises(ValueError, match="CUDA"):
        resolve_backend_name("flash_attn", torch.device("cpu"))


def test_the_triton_backend_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend triton: .*TRITON_INTERPRET=1"):
        resolve_backend_name("triton", torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert resolve_backend_name("triton", torch.device("cpu")) == "triton"


def test_kernel_dtypes_are_enforced_with_a_clear_error():
    backend = _flash(FLASH_ATTN, dtypes=ref.KERNEL_DTYPES, page_multiple=256)
    assert backend.kernel_name == "flash-attn reference" and backend.block_multiple == 256
    with pytest.raises(ValueError, match="runs float16, bfloat16, not float32"):
        _step(block_size=256).run(backend)
    _step(block_size=256, dtype=torch.bfloat16).run(backend)


def test_use_backend_refuses_a_block_size_the_kernels_do_not_take(make_tiny_engine):
    engine = make_tiny_engine(attention_backend="torch", block_size=16)
    with pytest.raises(ValueError, match="multiple of 256"):
        use_backend(engine, _flash(FLASH_ATTN, page_multiple=256))


def test_torch_varlen_derives_its_extra_tensors_once_per_step():
    step = _step("mixed")
    provider = reference_provider(TORCH_VARLEN)
    backend = FlashAttention(provider)
    step.run(backend)
    first = provider._step[1]
    for _ in range(2):  # the step's other layers reuse them
        step.run(backend)
        assert provider._step[1] is first
    assert first["prefill_seqused_k"].tolist() == [ctx for _, ctx in CPU_CASES["mixed"][1]]
    assert first["decode_cu_k"].tolist() == [0, 5, 305, 338]
    assert first["decode_cu_q"].tolist() == [0, 1, 2, 3]
    assert all(t.dtype == torch.int32 for t in first.values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU checks run on CUDA")
def test_gpu_checks_skip_without_cuda():
    for report in (run_all(), compare_with_reference(FLASH_ATTN),
                   probe_block_sizes(TORCH_VARLEN), probe_batch_invariance(TORCH_VARLEN)):
        assert report == {"skipped": "no CUDA"}
        json.dumps(report)
