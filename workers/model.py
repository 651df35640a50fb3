"""A compact Llama-family decoder (Llama 2/3, Qwen2, Mistral, SmolLM) over a paged KV cache.

Weights come straight from the checkpoint's tensors; q/k/v and gate/up are fused into one matmul
each, which keeps the per-layer op count (and so Python overhead per step) small. Every op follows
transformers' Llama code in the same order and dtype so greedy output matches `generate()`.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from workers.attention import AttentionMetadata
from workers.rope import rotate


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


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
    """nn.Linear that can run on oneDNN on CPU, its weight prepacked into oneDNN's layout.

    Prepacked oneDNN beats F.linear's MKL path at every batch size we step with on this CPU
    (measured: ~2x at 1 row, which is memory-bound, ~2.2x at 32 rows, ~1.25x at 512; unpacked
    oneDNN reorders the weight on every call and is ~25 % slower at 32 rows). Each row's output is
    bit-identical at every row count, so batching does not change a request's numbers. But oneDNN
    keeps memory for every row count it has run (measured: ~0.5 MB per count and weight shape,
    1.1 GB after rows 1..512 for our 4 projection shapes; F.linear keeps none), and a serving
    step's token count takes any value up to the budget: so rows are padded to `padded_rows`.
    """

    use_onednn: bool = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_onednn:
            return F.linear(x, self.weight, self.bias)
        rows = x.shape[0]  # x: [rows, in_features]
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


class RMSNorm(nn.Module):
    kernels: ModuleType | None = None  # workers.cpu_kernels, on fp32 CPUs

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
    kernels: ModuleType | None = None  # workers.cpu_kernels, on fp32 CPUs

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = (q_size, kv_size, kv_size)
        self.qkv_proj = Linear(config.hidden_size, sum(self.split), bias=bias)
        self.o_proj = Linear(
            q_size, config.hidden_size, bias=getattr(config, "attention_bias", False)
        )

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
        qkv = self.qkv_proj(x).view(tokens, -1, self.head_dim)  # [tokens, heads + 2 kv_heads, d]
        rotated = self.num_heads + self.num_kv_heads
        if self.kernels is not None:  # q and k rotated in place, one pass
            self.kernels.rotary_(qkv, rotated, cos, sin)
            qk = qkv[:, :rotated]
        else:  # q and k rotated in one go: the same elementwise ops, half the op launches
            qk = rotate(qkv[:, :rotated], cos, sin)
        q, k = qk.split((self.num_heads, self.num_kv_heads), dim=1)
        v = qkv[:, rotated:]
        out = backend(q, k, v, kv[0], kv[1], meta, self.scale)  # [tokens, heads, head_dim]
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    kernels: ModuleType | None = None  # workers.cpu_kernels, on fp32 CPUs

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, h, cos, sin, kv, meta, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, kv, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class CausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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
        h = self.embed_tokens(input_ids)
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            h = layer(h, cos, sin, kv, meta, backend)
        return h

    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [rows, hidden] -> fp32 logits [rows, vocab]."""
        return self.lm_head(self.norm(h)).float()

    def use_onednn_matmuls(self) -> None:
        """CPU only: route every projection through oneDNN, weights prepacked (see `Linear`).
        A tied lm_head gets its own packed copy; the embedding keeps the plain table."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_onednn()

    def use_cpu_kernels(self, kernels: ModuleType) -> None:
        """fp32 CPU only: norms, RoPE and the MLP activation in kvserve's fused C++ kernels."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, Attention, MLP)):
                module.kernels = kernels

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy Hugging Face-named tensors in, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
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
            own.pop(key).copy_(tensor)
        missing = [
            k for k in own if not (k == "lm_head.weight" and self.config.tie_word_embeddings)
        ]
        if missing:
            raise KeyError(f"checkpoint lacks {missing[:5]}")


def _fuse(
    tensors: dict[str, torch.Tensor], prefix: str, parts: tuple[str, ...], fused: str
) -> None:
    for kind in ("weight", "bias"):
        names = [f"{prefix}{p}.{kind}" for p in parts]
        if all(n in tensors for n in names):
            tensors[f"{prefix}{fused}.{kind}"] = torch.cat([tensors.pop(n) for n in names])
