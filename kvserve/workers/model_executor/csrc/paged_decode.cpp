// Paged decode attention for CPUs: one query token per sequence, keys and values read in place
// from the block pool (no gather copy), each KV head's block read once for all of its query heads.
// fp32 or bf16 (q, caches and output in one dtype): bf16 values are widened to fp32 as they are
// read and everything is computed in fp32 (scores, softmax, the weighted sum of values), rounded to
// bf16 once at the end; a bf16 cache is half the bytes to read, which is what a long context's
// decode step waits on. Built at first use with the other CPU kernels: see kvserve/workers/model_executor/cpu_kernels.py.
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include "bf16.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head

// an element as fp32 (bf16: its bits, uint16_t, widened exactly), and back (bf16: rounded as
// torch rounds); fp32 as it is
inline float widen(float v) { return v; }
inline float widen(uint16_t b) { return kvserve_bf16::widen(b); }
inline void narrow(float v, float* out) { *out = v; }
inline void narrow(float v, uint16_t* out) { *out = kvserve_bf16::narrow(v); }

struct Shape {
  int64_t block_size, kv_heads, group, q_row_stride;
};

// One (sequence, KV head): out[g] = softmax(q[g] . K^T * scale) V for its `group` query heads,
// over the keys first..length-1 (first > 0: a sliding window; the blocks before it are never
// read, they may have been freed). q, out: [group, D]; table: the sequence's block ids; scores:
// scratch of group * (length - first) floats. T: float, or uint16_t for bf16.
template <int D, typename T>
void attend_one(T* __restrict__ out, const T* __restrict__ q_in, const T* k_cache,
                const T* v_cache, const int32_t* table, int64_t first, int64_t length,
                int64_t kv_head, const Shape& shape, float scale, float softcap,
                std::vector<float>& scores) {
  const int64_t G = shape.group, BS = shape.block_size;
  const int64_t token_stride = shape.kv_heads * D;  // cache: [blocks, block_size, kv_heads, D]
  const int64_t block_stride = BS * token_stride;
  float q[kMaxGroup][D];
  float acc[kMaxGroup][D];
  for (int64_t g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) {
      q[g][d] = widen(q_in[g * D + d]) * scale;
      acc[g][d] = 0.f;
    }
  const int64_t n = length - first;  // keys seen; scores[g * n + (t - first)]
  scores.resize(G * n);
  for (int64_t t = first; t < length;) {  // scores = q K^T, a block at a time
    const int64_t start = t - t % BS, stop = std::min(start + BS, length);
    const T* block = k_cache + table[start / BS] * block_stride + kv_head * D;
    for (; t < stop; ++t) {
      const T* __restrict__ k = block + (t - start) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[g][d] * widen(k[d]);
        if (softcap > 0.f) dot = std::tanh(dot / softcap) * softcap;  // Gemma 2
        scores[g * n + (t - first)] = dot;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax, one row per query head
    float* row = scores.data() + g * n;
    const float max = *std::max_element(row, row + n);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      row[t] = std::exp(row[t] - max);
      sum += row[t];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < n; ++t) row[t] *= inv;
  }
  for (int64_t t = first; t < length;) {  // out = p V
    const int64_t start = t - t % BS, stop = std::min(start + BS, length);
    const T* block = v_cache + table[start / BS] * block_stride + kv_head * D;
    for (; t < stop; ++t) {
      const T* __restrict__ v = block + (t - start) * token_stride;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * n + (t - first)];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * widen(v[d]);
      }
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int d = 0; d < D; ++d) narrow(acc[g][d], out + g * D + d);
}

// data<T>: a tensor's elements as T (bf16 as its bits)
template <typename T>
const T* data(const at::Tensor& t) { return static_cast<const T*>(t.data_ptr()); }

template <int D, typename T>
void paged_decode_impl(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                       const at::Tensor& v_cache, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, float scale, int64_t window,
                       float softcap) {
  const int64_t seqs = q.size(0), heads = q.size(1), kv_heads = k_cache.size(2);
  const Shape shape{k_cache.size(1), kv_heads, heads / kv_heads, q.stride(0)};
  const int64_t max_blocks = block_tables.size(1);
  const T* q_ptr = data<T>(q);
  const T* k_ptr = data<T>(k_cache);
  const T* v_ptr = data<T>(v_cache);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  T* out_ptr = static_cast<T*>(out.data_ptr());
  at::parallel_for(0, seqs * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / kv_heads, h = item % kv_heads;
      const int64_t first_head = h * shape.group;
      const int64_t first_key = window > 0 ? std::max<int64_t>(0, lens[s] - window) : 0;
      attend_one<D, T>(out_ptr + (s * heads + first_head) * D,
                       q_ptr + s * shape.q_row_stride + first_head * D, k_ptr, v_ptr,
                       tables + s * max_blocks, first_key, lens[s], h, shape, scale, softcap,
                       scores);
    }
  });
}

}  // namespace

// q: [seqs, heads, D] (rows may be strided); caches: [blocks, block_size, kv_heads, D] contiguous;
// block_tables: [seqs, max_blocks] int32; context_lens: [seqs] int32; window: keys each query
// sees back from itself (a sliding-window layer), 0 for all; softcap > 0: each score becomes
// softcap * tanh(score / softcap) (Gemma 2) -> out: [seqs, heads, D]
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t window, double softcap) {
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
              k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: fp32 or bf16 q and caches, all of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "paged_decode: q rows must be dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: caches dense");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() &&
              context_lens.scalar_type() == at::kInt, "paged_decode: int32 tables and lengths");
  TORCH_CHECK(block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "paged_decode: one block table and one length per sequence");
  TORCH_CHECK(context_lens.is_contiguous(), "paged_decode: dense context_lens");
  // a plain loop, not a tensor reduction: this runs once per layer of every decode step
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int64_t capacity = block_tables.size(1) * k_cache.size(1);
  for (int64_t s = 0; s < q.size(0); ++s)
    TORCH_CHECK(lens[s] >= 1 && lens[s] <= capacity,
                "paged_decode: every sequence attends to 1..(its block table's tokens) tokens");
  const int64_t heads = q.size(1), kv_heads = k_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && heads / kv_heads <= kMaxGroup,
              "paged_decode: at most 16 query heads per KV head");
  auto out = at::empty({q.size(0), heads, q.size(2)}, q.options());
  const auto s = static_cast<float>(scale);
  const auto cap = static_cast<float>(softcap);
  const bool bf16 = q.scalar_type() == at::kBFloat16;
  switch (q.size(2)) {
    case 64:
      if (bf16) {
        paged_decode_impl<64, uint16_t>(out, q, k_cache, v_cache, block_tables, context_lens, s,
                                          window, cap);
      } else {
        paged_decode_impl<64, float>(out, q, k_cache, v_cache, block_tables, context_lens, s,
                                          window, cap);
      }
      break;
    case 128:
      if (bf16) {
        paged_decode_impl<128, uint16_t>(out, q, k_cache, v_cache, block_tables, context_lens, s,
                                          window, cap);
      } else {
        paged_decode_impl<128, float>(out, q, k_cache, v_cache, block_tables, context_lens, s,
                                          window, cap);
      }
      break;
    default: TORCH_CHECK(false, "paged_decode: head_dim 64 or 128");
  }
  return out;
}
