// One decoder layer of a decode-only step in a single call: the same kernels, in the same order,
// as the Python layer (kvserve/workers/model_executor/model.py) with the `cpu` attention backend, so the numbers are
// bit-identical; what goes is ~14 Python op launches per layer (~2.5 ms a step at batch 1, where
// the projections take ~18 ms). fp32, or bf16 throughout (weights packed for `linear_bf16`,
// activations, caches, cos/sin), where each kernel rounds where transformers' bf16 ops do.
#include <ATen/TensorOperators.h>  // h + ...

#include "kernels.h"

namespace {

// weights: the layer's tensors in `Weight` order; an empty tensor is a missing bias
enum Weight { kInNorm, kQKV, kQKVBias, kO, kOBias, kPostNorm, kGateUp, kGateUpBias, kDown,
              kDownBias, kNumWeights };

c10::optional<at::Tensor> bias(const std::vector<at::Tensor>& w, Weight which) {
  if (w[which].numel() == 0) return c10::nullopt;
  return w[which];
}

// x [rows, K] -> [rows, n] through the kernel the weight was packed for
at::Tensor project(const at::Tensor& x, const std::vector<at::Tensor>& w, Weight which,
                   int64_t n) {
  const Weight b = static_cast<Weight>(which + 1);  // each projection's bias follows it
  if (w[which].scalar_type() == at::kBFloat16) return linear_bf16(x, w[which], n, bias(w, b));
  if (w[which].scalar_type() == at::kByte) return linear_codes(x, w[which], n, bias(w, b));
  return linear(x, w[which], n, bias(w, b));
}

}  // namespace

// h: [seqs, hidden] -> h after the layer; dims: {heads, kv_heads, head_dim, intermediate};
// cos, sin: [seqs, head_dim]; caches: [blocks, block_size, kv_heads, head_dim];
// slot_mapping: [seqs] long; block_tables: [seqs, max_blocks] int32; context_lens: [seqs] int32;
// window: the layer's sliding window (0: none)
at::Tensor decode_layer(const at::Tensor& h, const std::vector<at::Tensor>& w,
                        const std::vector<int64_t>& dims, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale, double eps,
                        int64_t window) {
  TORCH_CHECK(w.size() == kNumWeights && dims.size() == 4,
              "decode_layer: 10 weights and dims {heads, kv_heads, head_dim, intermediate}");
  const int64_t seqs = h.size(0), hidden = h.size(1);
  const int64_t heads = dims[0], kv_heads = dims[1], D = dims[2], inter = dims[3];
  // attention: norm, q/k/v, RoPE on q and k, K/V into the cache, paged attention, output
  auto x = rms_norm(h, w[kInNorm], eps);
  auto qkv = project(x, w, kQKV, (heads + 2 * kv_heads) * D)
                 .view({seqs, heads + 2 * kv_heads, D});
  rotary_(qkv, heads + kv_heads, cos, sin);
  k_cache.view({-1, kv_heads, D}).index_copy_(0, slot_mapping, qkv.narrow(1, heads, kv_heads));
  v_cache.view({-1, kv_heads, D})
      .index_copy_(0, slot_mapping, qkv.narrow(1, heads + kv_heads, kv_heads));
  auto attn = paged_decode(qkv.narrow(1, 0, heads), k_cache, v_cache, block_tables, context_lens,
                           scale, window, 0.0);  // [seqs, heads, D]
  auto out = h + project(attn.view({seqs, heads * D}), w, kO, hidden);
  // MLP: norm, gate and up, SiLU(gate) * up, down
  x = rms_norm(out, w[kPostNorm], eps);
  auto act = silu_and_mul(project(x, w, kGateUp, 2 * inter));
  return out + project(act, w, kDown, hidden);
}
