"""A compact Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM) over a paged KV cache.

Weights come straight from the checkpoint's tensors; q/k/v and gate/up are fused into one matmul
each, which keeps the per-layer op count (and so Python overhead per step) small. Every op follows
transformers' Llama code in the same order and dtype so greedy output matches `generate()`.

With a tensor-parallel group (`tp`) each rank builds the same model over its slice
(nano-vllm's and Megatron's split, `kvserve.workers.parallel.shard`): the embedding and the LM
head by vocabulary, q/k/v by heads and gate/up by columns, o_proj and down_proj by rows with one
all-reduce each; norms and RoPE whole on every rank. The kernels run unchanged on the local
sizes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.workers.model_executor.attention import AttentionMetadata
from kvserve.workers.model_executor.attention.cpu_backend import CPUAttention
from kvserve.workers.model_executor.cpu_kernels import (
    CpuKernels,
    elementwise_available_for,
    linear_available_for,
)
from kvserve.workers.model_executor.families import family_of, layer_windows
from kvserve.workers.model_executor.rope import rope_part, rotate
from kvserve.workers.parallel import shard

if TYPE_CHECKING:  # (transformers is imported to load a checkpoint, not with the model)
    from transformers import PretrainedConfig

    from kvserve.workers.parallel.group import TPGroup


@functools.cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN's prepacked matmuls run `dtype` on this CPU. Probed, not assumed: its fp16 path
    needs AVX512-FP16 or AVX-NE-CONVERT (Intel Sapphire Rapids has them, AMD Zen 4 does not)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_ROWS)
    except RuntimeError:
        return False
    return True


def padded_rows(rows: int) -> int:
    """The row count a oneDNN matmul runs at: exact up to 16, else rounded up to 8 steps per
    doubling (at most 12.5 % padding), so a replica sees a few dozen shapes, not every one."""
    if rows <= 16:
        return rows
    step = 1 << (rows.bit_length() - 4)  # rows in [2^k, 2^(k+1)): step 2^(k-3)
    return -(-rows // step) * step


# the batch size oneDNN lays packed weights out for: fastest from 8 rows up on this CPU, and the
# same speed as a plain weight at 1 row (measured, SmolLM2's projection shapes)
PACK_ROWS = 32


class Linear(nn.Linear):
    """nn.Linear that runs, on CPU, kvserve's own kernel or oneDNN, its weight prepacked.

    With kvserve's CPU kernels (fp32, AVX-512 or AVX2) the weight is packed into 48-output
    panels and `kernels.linear` computes each output as one multiply-add chain over the inputs
    in order, so a row's numbers are the same at every batch size; at one row it is a single
    sequential read of the weights, which is what bounds batch-1 decode (measured on SmolLM2's
    shapes against prepacked oneDNN: 1.1-3x faster at 1 row, 1.04-1.3x at 32 rows, equal at
    256).

    Otherwise prepacked oneDNN: it beats F.linear's MKL path at every batch size we step with on
    this CPU (~2x at 1 row, ~2.2x at 32, ~1.25x at 512), and each row's output is bit-identical at
    every row count too. But oneDNN keeps memory for every row count it has run (~0.5 MB per count
    and weight shape; F.linear keeps none), and a serving step's token count takes any value up to
    the budget: so its rows are padded to `padded_rows`.
    """

    use_onednn: bool = False
    kernel: Callable | None = None  # kernels.linear / linear_bf16, when the weight is packed for it

    def reset_parameters(self) -> None:
        """No random initialisation on the meta device: a model is built there and every
        weight then comes from the checkpoint (`CausalLM.load_checkpoint` refuses a missing
        one), and nn.Linear's kaiming init on meta still ran torch's Python decomposition,
        0.17 CPU-s an engine."""
        if not self.weight.is_meta:
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:  # x: [rows, in_features]
            return self.kernel(x, self.weight, self.out_features, self.bias)
        if not self.use_onednn:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]
        pad = padded_rows(rows) - rows
        if pad:
            x = F.pad(x, (0, 0, 0, pad))
        out = torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return out[:rows] if pad else out

    def pack_for_onednn(self) -> None:
        """Swap the weight for a oneDNN-packed copy (the plain one is freed, unless a tied
        embedding still holds it)."""
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_ROWS)
        self.weight = nn.Parameter(packed, requires_grad=False)
        self.use_onednn = True

    def pack_for_kernels(self, kernels: CpuKernels, weight_codes: bool = True) -> None:
        """Swap the weight for panels of `kernels.linear` (fp32) or `kernels.linear_bf16`
        (bf16), as `pack_for_onednn` does. fp32 with `weight_codes`: the block codes of
        `kernels.linear_codes` where they give back every weight exactly (a GGUF checkpoint's
        Q4_1 and Q8_0 tensors): `linear`'s outputs bit for bit from 0.75 or 1.125 bytes a weight
        instead of 4, and batch-1 decode is bound by reading the weights once."""
        weight = self.weight.detach()
        codes = (kernels.pack_linear_weight_codes(weight)
                 if weight_codes and weight.dtype == torch.float32 else None)
        if weight.dtype == torch.bfloat16:
            packed, self.kernel = kernels.pack_linear_weight_bf16(weight), kernels.linear_bf16
        elif codes is not None and codes.numel():
            packed, self.kernel = codes, kernels.linear_codes
        else:
            packed, self.kernel = kernels.pack_linear_weight(weight), kernels.linear
        self.weight = nn.Parameter(packed, requires_grad=False)


class RMSNorm(nn.Module):
    kernels: CpuKernels | None = None  # cpu_kernels, in fp32 and bf16 on CPUs

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    kernels: CpuKernels | None = None  # cpu_kernels, in fp32 and bf16 on CPUs
    triton_ops: ModuleType | None = None  # triton_ops, with the triton attention backend

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None,
                 window: int = 0, rope_part: int | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.window = window  # keys a query sees back from itself; 0: the whole context
        # Gemma 3: its layer type's block of the stacked cos/sin (rope.RotaryEmbedding.lookup)
        self.rope_part = rope_part
        size = tp.size if tp else 1
        # this rank's heads (all of them without tp)
        self.num_heads = config.num_attention_heads // size
        self.num_kv_heads = config.num_key_value_heads // size
        self.head_dim = shard.head_dim(config)
        family = family_of(config)
        # Gemma scales by its query_pre_attn_scalar, not the head dim
        scalar = getattr(config, "query_pre_attn_scalar", None) if family.gemma else None
        self.scale = (scalar or self.head_dim) ** -0.5
        # Gemma 2: scores soft-capped, cap * tanh(score / cap), before the mask; 0: none
        self.softcap = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
        bias = getattr(config, "attention_bias", False) or family.qkv_bias
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=bias)
        self.o_proj = Linear(
            q_size, config.hidden_size, bias=getattr(config, "attention_bias", False)
        )
        # Qwen3: each head's q and k RMS-normalised over head_dim (one weight for all heads,
        # whole on every tp rank), before RoPE
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if family.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if family.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.rope_part is not None:  # cos/sin: [layer types * tokens, d] -> [tokens, d]
            rows = slice(self.rope_part * tokens, (self.rope_part + 1) * tokens)
            cos, sin = cos[rows], sin[rows]
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)  # [tokens, heads + 2 kv_heads, d]
        rotated = self.num_heads + self.num_kv_heads
        if self.q_norm is not None:
            self._norm_qk_(qkv)
        if self.triton_ops is not None:  # q, k rotated in place, k and v written to the cache
            self.triton_ops.rotary_write_kv_(qkv, self.num_heads, self.num_kv_heads, cos, sin,
                                             kv[0], kv[1], meta.slot_mapping)
            q, k, v = qkv.split((self.num_heads, self.num_kv_heads, self.num_kv_heads), dim=1)
            out = backend.attend(q, k, v, kv[0], kv[1], meta, self.scale, self.window,
                                 self.softcap)
            return self._project_out(out.reshape(tokens, -1))
        if self.kernels is not None:  # q and k rotated in place, one pass
            self.kernels.rotary_(qkv, rotated, cos, sin)
            qk = qkv[:, :rotated]
        else:  # q and k rotated in one go: the same elementwise ops, half the op launches
            qk = rotate(qkv[:, :rotated], cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, rotated:]
        # [tokens, heads, head_dim]
        out = backend(q, k, v, kv[0], kv[1], meta, self.scale, self.window, self.softcap)
        return self._project_out(out.reshape(tokens, -1))

    def _norm_qk_(self, qkv: torch.Tensor) -> None:
        """q and k heads of `qkv` RMS-normalised in place, each over its head_dim, so the
        rotary paths after it (in place, or fused with the cache write) are unchanged."""
        q = qkv[:, :self.num_heads]  # [tokens, heads, d]
        k = qkv[:, self.num_heads:self.num_heads + self.num_kv_heads]  # [tokens, kv_heads, d]
        q.copy_(self.q_norm(q.reshape(-1, self.head_dim)).view_as(q))
        k.copy_(self.k_norm(k.reshape(-1, self.head_dim)).view_as(k))

    def _project_out(self, out: torch.Tensor) -> torch.Tensor:
        """out: [tokens, heads * head_dim] -> [tokens, hidden]; under tp each rank's heads give
        a partial sum (o_proj is split by its input rows), summed over the ranks."""
        out = self.o_proj(out)
        return self.tp.all_reduce(out) if self.tp else out


class MLP(nn.Module):
    # gate_up [rows, 2 * intermediate] -> silu(gate) * up: cpu_kernels' on CPUs, triton_ops'
    # with the triton backend; None: torch's ops
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        # the gate's activation: SiLU (SwiGLU), or tanh-approximated GELU (Gemma's GeGLU)
        self.gelu = family_of(config).gemma
        self.intermediate = config.intermediate_size // (tp.size if tp else 1)  # this rank's
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            out = self.down_proj(self.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
            out = self.down_proj(act * up)
        return self.tp.all_reduce(out) if self.tp else out  # down_proj's partial sums


class SparseMoE(nn.Module):
    """Mixtral's sparse mixture of experts, in place of the MLP: a router scores the experts
    (softmax in fp32), each token takes its top num_experts_per_tok, their weights
    renormalised to sum to 1; each expert is SwiGLU with its own weights.

    Grouped by expert, as transformers' MixtralExperts and vLLM's fused MoE: the tokens are
    sorted by the experts they chose, and each expert runs one matmul over all of its tokens,
    so a step costs a loop over the experts hit, not over tokens. Each token's expert outputs
    are added in ascending expert order, as transformers adds them."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_experts = config.num_local_experts
        self.top_k = config.num_experts_per_tok
        self.intermediate = config.intermediate_size
        self.gate = Linear(config.hidden_size, self.num_experts, bias=False)  # the router
        self.experts = nn.Module()
        # per expert: gate and up stacked, [experts, 2 * intermediate, hidden]; down,
        # [experts, hidden, intermediate] (transformers' MixtralExperts layout)
        self.experts.gate_up_proj = nn.Parameter(torch.empty(
            self.num_experts, 2 * self.intermediate, config.hidden_size), requires_grad=False)
        self.experts.down_proj = nn.Parameter(torch.empty(
            self.num_experts, config.hidden_size, self.intermediate), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [tokens, hidden]; the router's probabilities in fp32, as transformers'
        probs = torch.softmax(self.gate(x).float(), dim=-1)  # [tokens, experts]
        weights, chosen = probs.topk(self.top_k, dim=-1)  # [tokens, top_k]
        weights /= weights.sum(dim=-1, keepdim=True)
        flat = chosen.flatten()  # [tokens * top_k]: (token, choice) pairs, token-major
        order = flat.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start:start + n]
            start += n
            rows = pairs // self.top_k  # its tokens, in token order
            gate, up = F.linear(x[rows], self.experts.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.experts.down_proj[expert])
            y = y * weights.flatten()[pairs, None]  # fp32, as transformers' product
            out.index_add_(0, rows, y.to(out.dtype))
        return out


def _stack_experts(tensors: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """A Mixtral checkpoint's per-expert tensors (block_sparse_moe.experts.N.w1/w3/w2, as on
    the Hub and as transformers saves them) as the stacked layout of `SparseMoE`."""
    tensors = dict(tensors)
    for i in range(layers):
        old, new = f"model.layers.{i}.block_sparse_moe.", f"model.layers.{i}.mlp."
        if old + "gate.weight" not in tensors:
            continue
        tensors[new + "gate.weight"] = tensors.pop(old + "gate.weight")
        gate_up, down, e = [], [], 0
        while f"{old}experts.{e}.w1.weight" in tensors:
            w1, w2, w3 = (tensors.pop(f"{old}experts.{e}.{w}.weight") for w in ("w1", "w2", "w3"))
            gate_up.append(torch.cat([w1, w3]))
            down.append(w2)
            e += 1
        tensors[new + "experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[new + "experts.down_proj"] = torch.stack(down)
    return tensors


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None,
                 window: int = 0, rope_part: int | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp, window, rope_part)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SparseMoE(config) if family_of(config).moe else MLP(config, tp)
        # Gemma's sandwich: its post_attention_layernorm normalises the attention's output, and
        # two more norms come before and after the MLP
        self.sandwich = family_of(config).gemma
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h, cos, sin, kv, meta, backend) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(h), cos, sin, kv, meta, backend)
        if self.sandwich:
            h = h + self.post_attention_layernorm(attn)
            return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h))

    def decode_weights(self) -> list[torch.Tensor]:
        """The tensors `kernels.decode_layer` takes, in its order (an empty tensor: no bias)."""
        attn, mlp, none = self.self_attn, self.mlp, torch.empty(0)
        return [
            self.input_layernorm.weight, attn.qkv_proj.weight, _or(attn.qkv_proj.bias, none),
            attn.o_proj.weight, _or(attn.o_proj.bias, none), self.post_attention_layernorm.weight,
            mlp.gate_up_proj.weight, _or(mlp.gate_up_proj.bias, none), mlp.down_proj.weight,
            _or(mlp.down_proj.bias, none),
        ]


class CausalLM(nn.Module):
    decode_kernels: CpuKernels | None = None  # cpu_kernels, for decode-only steps
    triton_ops: ModuleType | None = None  # triton_ops: every layer's norms and RoPE in Triton
    decode_weights: list[list[torch.Tensor]]  # per layer, as `DecoderLayer.decode_weights`

    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.family = family_of(config)  # an architecture kvserve does not implement: refused
        shard.check_divisible(config, tp.size if tp else 1)
        # this rank's vocabulary rows: [vocab_start, vocab_start + vocab)
        self.vocab, self.vocab_start = shard.vocab_range(config, tp)
        # an uninitialised weight (`_weight`): the checkpoint overwrites it, and initialising
        # it on the meta device (`_build_model`) runs torch's Python `normal_`, whose first
        # call imports torch._dynamo (0.65 CPU-s of every engine process's start)
        self.embed_tokens = nn.Embedding(
            self.vocab, config.hidden_size, _weight=torch.empty(self.vocab, config.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(config, tp, window, rope_part(config, i))
                                    for i, window in enumerate(layer_windows(config)))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, self.vocab, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.requires_grad_(False)

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        backend,
    ) -> torch.Tensor:
        """input_ids: [tokens] -> hidden states [tokens, hidden] (final norm not applied)."""
        h = self.embed(input_ids)
        if self.decode_kernels is not None and backend.name == "cpu" and not meta.prefills:
            return self._decode_in_kernels(h, cos, sin, kv_cache, meta)
        if self.triton_ops is not None and not self.family.gemma:  # (Gemma: its sandwich)
            return self._forward_fused(h, cos, sin, kv_cache, meta, backend)
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            h = layer(h, cos, sin, kv, meta, backend)
        return h

    def _forward_fused(self, h, cos, sin, kv_cache, meta: AttentionMetadata,
                       backend) -> torch.Tensor:
        """The layers with each residual add fused into the norm after it (vLLM's
        fused_add_rms_norm): the same sums, rounded where `DecoderLayer.forward` rounds them,
        in half the launches. A host-bound GPU step pays per launch, not per byte."""
        norm = self.triton_ops.rms_norm
        residual = None
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
            if residual is None:
                residual, x = h, norm(h, ln1.weight, ln1.eps)
            else:  # h: the previous layer's MLP output
                x, residual = norm(h, ln1.weight, ln1.eps, residual)
            h = layer.self_attn(x, cos, sin, kv, meta, backend)
            x, residual = norm(h, ln2.weight, ln2.eps, residual)
            h = layer.mlp(x)
        return residual + h

    def _decode_in_kernels(self, h, cos, sin, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """A decode-only step, a layer per C++ call (`csrc/decode_layer.cpp`): the same
        kernels in the same order as `forward`'s layers with the `cpu` backend, without Python's
        per-op overhead."""
        attn = self.layers[0].self_attn
        dims = [attn.num_heads, attn.num_kv_heads, attn.head_dim, self.layers[0].mlp.intermediate]
        eps = self.layers[0].input_layernorm.eps
        for layer, weights, (k_cache, v_cache) in zip(self.layers, self.decode_weights, kv_cache,
                                                      strict=True):
            h = self.decode_kernels.decode_layer(
                h, weights, dims, cos, sin, k_cache, v_cache, meta.slot_mapping,
                meta.decode_block_tables, meta.decode_context_lens, attn.scale, eps,
                layer.self_attn.window)
        return h

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: [tokens] -> [tokens, hidden]. Under tp each rank looks up the ids in its
        vocabulary slice, zeros elsewhere, and the sum over the ranks is every row exactly (one
        rank's row plus zeros). Gemma's rows are scaled by sqrt(hidden), rounded to the model's
        dtype as transformers rounds it."""
        if self.tp is None:
            h = self.embed_tokens(input_ids)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.vocab)
            h = self.embed_tokens(local.masked_fill(outside, 0))
            h = self.tp.all_reduce(h.masked_fill_(outside[:, None], 0.0))
        if self.family.gemma:
            h = h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor | None:
        """h: [rows, hidden] -> fp32 logits [rows, vocab]. Under tp each rank computes its
        vocabulary slice's, and rank 0 gets them all (in rank order: the vocabulary's); the
        other ranks get None."""
        logits = self.lm_head(self.norm(h))
        if cap := getattr(self.config, "final_logit_softcapping", None):  # Gemma 2
            logits = torch.tanh(logits / cap) * cap
        logits = logits.float()
        if self.tp is None:
            return logits
        return self.tp.gather_last_dim(logits)

    def use_onednn_matmuls(self) -> None:
        """CPU only: route the projections `use_cpu_kernels` did not take through oneDNN,
        weights prepacked (see `Linear`). A tied lm_head gets its own packed copy; the embedding
        keeps the plain table."""
        for module in self.modules():
            if isinstance(module, Linear) and module.kernel is None:
                module.pack_for_onednn()

    def use_cpu_kernels(self, kernels: CpuKernels, weight_codes: bool = True) -> None:
        """CPU only, fp32 and bf16 (bf16 needs AVX2 or AVX-512): norms, RoPE, the MLP
        activation and (with AVX2 or AVX-512) the projections in kvserve's C++ kernels; where
        the `cpu` attention backend covers the shapes, decode-only steps run a layer per call.
        bf16's elementwise kernels round where transformers' bf16 ops do (bit-identical); its
        projections are `linear_bf16` (batch-invariant; oneDNN's bf16 GEMV is 2-3x slower at one
        row). A tied lm_head gets its own packed copy, as with oneDNN."""
        dtype = self.lm_head.weight.dtype
        if elementwise_available_for(kernels, dtype):
            for module in self.modules():
                if isinstance(module, (RMSNorm, Attention)):
                    module.kernels = kernels
                elif isinstance(module, MLP) and not module.gelu:
                    module.silu_and_mul = kernels.silu_and_mul
        if linear_available_for(kernels, dtype):
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack_for_kernels(kernels, weight_codes)
        attn = self.layers[0].self_attn
        # a layer per C++ call has no place for tp's all-reduces, Qwen3's q/k norms or Gemma's
        # sandwich: there, decode steps run the same kernels op by op
        if (self.tp is None and not self.family.qk_norm and not self.family.gemma
                and not self.family.moe and linear_available_for(kernels, dtype)
                and elementwise_available_for(kernels, dtype)
                and CPUAttention.covers_shape(dtype, attn.num_heads, attn.num_kv_heads,
                                              attn.head_dim)):
            self.decode_kernels = kernels
            self.decode_weights = [layer.decode_weights() for layer in self.layers]

    def use_triton_kernels(self) -> None:
        """With the triton attention backend (CUDA; a CPU under Triton's interpreter): norms
        with the residual add, SiLU-and-mul, and RoPE with the KV-cache write in Triton
        (`triton_ops`), each equal to the torch ops it replaces (tests/test_triton_ops.py)."""
        from kvserve.workers.model_executor import triton_ops

        self.triton_ops = triton_ops
        for module in self.modules():
            if isinstance(module, Attention):
                module.triton_ops = triton_ops
            elif isinstance(module, MLP) and not module.gelu:
                module.silu_and_mul = triton_ops.silu_and_mul

    def _unfused(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`tensors` with fused projections split into q/k/v and gate/up (views)."""
        attn, inter = self.layers[0].self_attn, self.config.intermediate_size
        q, kv = (self.config.num_attention_heads * attn.head_dim,
                 self.config.num_key_value_heads * attn.head_dim)
        tensors = dict(tensors)
        for name in [n for n in tensors if n.endswith((".qkv_proj.weight", ".qkv_proj.bias"))]:
            _split_fused(tensors, name, ("q_proj", "k_proj", "v_proj"), [q, kv, kv])
        for name in [n for n in tensors if n.endswith((".gate_up_proj.weight",
                                                       ".gate_up_proj.bias"))]:
            _split_fused(tensors, name, ("gate_proj", "up_proj"), [inter, inter])
        return tensors

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take Hugging Face-named tensors in, fusing q/k/v and gate/up.

        A tensor already in the parameter's dtype, device and shape becomes the parameter
        itself rather than being copied: the loader's tensors are read-only views of the
        safetensors file's page cache (mmap), shared by every process that loads the model,
        and nothing writes to weights. Copying would write the whole model into fresh memory,
        which costs more than reading it (~1.3 s for SmolLM2's 540 MB on a VM whose first
        touch of a page costs ~15 us); the fused and packed weights are new tensors anyway."""
        own = dict(self.named_parameters())
        if self.family.moe:
            tensors = _stack_experts(tensors, len(self.layers))
        if self.family.gemma:  # its norms apply (1 + w): the weights here hold 1 + w, in fp32
            tensors = {name: t.float() + 1.0 if name.endswith("norm.weight") else t
                       for name, t in tensors.items()}
        if self.tp is not None:  # this rank's slice of each tensor, before q/k/v are fused
            tensors = shard.slice_checkpoint(self._unfused(tensors), self.tp.rank,
                                             self.tp.size)
        for i in range(len(self.layers)):
            pre = f"model.layers.{i}."
            _fuse(tensors, pre + "self_attn.", ("q_proj", "k_proj", "v_proj"), "qkv_proj")
            _fuse(tensors, pre + "mlp.", ("gate_proj", "up_proj"), "gate_up_proj")
        for name, tensor in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue
            key = name.removeprefix("model.")
            if key == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if key not in own:
                raise KeyError(f"checkpoint tensor {name} has no place in the model")
            param = own.pop(key)
            if (tensor.dtype, tensor.device, tensor.shape) == (param.dtype, param.device,
                                                               param.shape):
                module, _, attr = key.rpartition(".")
                setattr(self.get_submodule(module), attr, nn.Parameter(tensor,
                                                                       requires_grad=False))
            else:
                param.copy_(tensor)
        if self.config.tie_word_embeddings:  # the embedding may be a new Parameter now
            self.lm_head.weight = self.embed_tokens.weight
        missing = [
            k for k in own if not (k == "lm_head.weight" and self.config.tie_word_embeddings)
        ]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:5]}")


def _split_fused(tensors: dict[str, torch.Tensor], name: str, parts: tuple[str, ...],
                 sizes: list[int]) -> None:
    """A checkpoint's fused projection (Phi-3's qkv_proj, gate_up_proj) back into its parts,
    as row views, so that tensor parallelism slices each part as it slices other families'."""
    module, _, kind = name.rpartition(".")  # e.g. model.layers.0.self_attn.qkv_proj, weight
    prefix = module.rpartition(".")[0]
    for part, piece in zip(parts, tensors.pop(name).split(sizes), strict=True):
        tensors[f"{prefix}.{part}.{kind}"] = piece


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor


def _fuse(
    tensors: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], fused: str
) -> None:
    for kind in ("weight", "bias"):
        names = [f"{prefix}{p}.{kind}" for p in parts]
        if all(n in tensors for n in names):
            tensors[f"{prefix}{fused}.{kind}"] = torch.cat([tensors.pop(n) for n in names])
