// Structured outputs' token mask on CPU logits (kvserve/workers/structured_output.py): every token
// a request's grammar forbids becomes -inf in its logits row. xgrammar 0.2.9's CPU apply takes
// ~4.7 ms for 32 rows of SmolLM2's 49,152 tokens (~10 % of a decode step at that batch); this
// makes one pass over each row, which the compiler vectorizes (a word's 32 lanes blend with -inf),
// in ~0.05 ms.
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/Parallel.h>

#include <cstdint>

namespace {

// -inf as fp32 bits: the kernels build with -ffast-math (finite math only), so the value is
// written as bits and never computed with
constexpr uint32_t kNegInf = 0xFF800000u;
constexpr int64_t kRowsPerTask = 4;  // a row is ~200 KB of logits

void mask_row(uint32_t* __restrict__ row, const uint32_t* __restrict__ words, int64_t vocab) {
  const int64_t full = vocab / 32;
  for (int64_t w = 0; w < full; ++w) {
    const uint32_t m = words[w];
    if (m == 0xFFFFFFFFu) continue;  // all 32 allowed
    uint32_t* __restrict__ out = row + w * 32;
    for (int b = 0; b < 32; ++b) out[b] = (m >> b) & 1u ? out[b] : kNegInf;
  }
  for (int64_t t = full * 32; t < vocab; ++t)
    if (!((words[t / 32] >> (t % 32)) & 1u)) row[t] = kNegInf;
}

}  // namespace

// logits [rows, >= vocab] fp32 (dense last dim), in place; bitmask [rows', ceil(vocab / 32)] int32,
// xgrammar's layout (token t allowed when bit t % 32 of word t / 32 is set); indices [n] int64:
// the rows to mask, each a row of both. Tokens at or past `vocab` are left as they are.
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& indices,
                          int64_t vocab) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask_: logits [rows, vocab] fp32 with a dense last dim");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kInt && bitmask.is_contiguous(),
              "apply_token_bitmask_: bitmask [rows, words] contiguous int32");
  TORCH_CHECK(indices.dim() == 1 && indices.scalar_type() == at::kLong && indices.is_contiguous(),
              "apply_token_bitmask_: indices [n] int64");
  TORCH_CHECK(vocab >= 0 && vocab <= logits.size(1) && (vocab + 31) / 32 <= bitmask.size(1),
              "apply_token_bitmask_: vocab ", vocab, " beyond the logits (", logits.size(1),
              ") or the bitmask (", bitmask.size(1), " words)");
  const int64_t n = indices.size(0), stride = logits.stride(0), words = bitmask.size(1);
  const int64_t* idx = indices.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(idx[i] >= 0 && idx[i] < logits.size(0) && idx[i] < bitmask.size(0),
                "apply_token_bitmask_: row ", idx[i], " out of range");
  auto* base = reinterpret_cast<uint32_t*>(logits.data_ptr<float>());
  const auto* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  at::parallel_for(0, n, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      mask_row(base + idx[i] * stride, bits + idx[i] * words, vocab);
  });
}
