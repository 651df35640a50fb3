// A batch-invariant fp32 linear layer for CPUs: out = x W^T (+ bias), W prepacked in panels.
//
// Every output element is one fused multiply-add chain over k = 0..K-1, in that order, whatever
// the row count or the tile it lands in: a row's numbers are the same alone or in a batch of 32
// (greedy and seeded outputs do not depend on their neighbours). The panel layout makes a
// one-row product a single sequential stream of the weights, which is what bounds batch-1 decode.
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <string>

#include "linear_tile.h"

using linear_tile::Isa;
using linear_tile::kNR;

bool linear_available() { return linear_tile::linear_isa() != Isa::kNone; }

// The instruction set `linear` and `linear_codes` run: "avx512", "avx2" or "" (neither)
std::string linear_isa() {
  switch (linear_tile::linear_isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "";
  }
}

// Run `isa` ("avx512", "avx2", or "none": torch's ops, as on a CPU with neither) where it is
// built and on this CPU, so that a CPU with both tests each; "" goes back to the best there is
void set_linear_isa(const std::string& isa) {
  const std::optional<Isa> wanted = isa == "avx512" ? std::optional<Isa>(Isa::kAvx512)
                                    : isa == "avx2" ? std::optional<Isa>(Isa::kAvx2)
                                    : isa == "none" ? std::optional<Isa>(Isa::kNone)
                                                    : std::nullopt;
  TORCH_CHECK(isa.empty() || wanted, "set_linear_isa: avx512, avx2, none or \"\", not ", isa);
  TORCH_CHECK(!wanted || (linear_tile::built_with(*wanted) && linear_tile::cpu_has(*wanted)),
              "set_linear_isa: ", isa, " is not built or not on this CPU");
  linear_tile::forced_isa() = wanted;
}

namespace {

template <typename I>
void linear_with(const float* xp, int64_t ldx, int64_t rows, int64_t K, const float* wp,
                 int64_t panels, float* op, int64_t n, const float* b) {
  // panels split over threads; each panel stays in cache while every row tile reads it
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kNR;
      linear_tile::panel_times_rows<I>(xp, ldx, rows, wp + p * K * kNR, K, op, n, n0,
                                       std::min(kNR, n - n0), b);
    }
  });
}

}  // namespace

// w: [N, K] -> panels [ceil(N / 48), K, 48], zero-padded past N. One pass: each panel is
// written while it sits in cache, from 48 rows read 16 columns (a cache line) at a time, so an
// engine's start packs its weights at about the speed of copying them
at::Tensor pack_linear_weight(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_in.dim() == 2,
              "pack_linear_weight: fp32 [N, K]");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kNR - 1) / kNR;
  auto packed = at::empty({panels, K, kNR}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  constexpr int64_t kCols = 16;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kNR, n_valid = std::min(kNR, N - n0);
      float* panel = dst + p * K * kNR;  // panel: [K, kNR]
      for (int64_t k0 = 0; k0 < K; k0 += kCols) {
        const int64_t cols = std::min(kCols, K - k0);
        for (int64_t j = 0; j < n_valid; ++j) {
          const float* row = src + (n0 + j) * K + k0;
          for (int64_t c = 0; c < cols; ++c) panel[(k0 + c) * kNR + j] = row[c];
        }
        for (int64_t j = n_valid; j < kNR; ++j)
          for (int64_t c = 0; c < cols; ++c) panel[(k0 + c) * kNR + j] = 0.0f;
      }
    }
  });
  return packed;
}

// x: [rows, K] (dense last dim), packed: [panels, K, 48] -> [rows, n]
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias) {
  const Isa isa = linear_tile::linear_isa();
  TORCH_CHECK(isa != Isa::kNone, "linear: built without AVX2 or AVX-512");
  const float* b = linear_tile::checked_inputs(x, bias, n, "linear");
  const int64_t rows = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(1) == K &&
              packed.size(2) == kNR && n > (panels - 1) * kNR && n <= panels * kNR,
              "linear: packed weight [panels, K, 48] for ", n, " outputs and K = ", K);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "linear: packed weight must start on a 64-byte boundary (pack_linear_weight's)");
  auto out = at::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0);
#ifdef __AVX512F__
  if (isa == Isa::kAvx512) {
    linear_with<linear_tile::Avx512>(xp, ldx, rows, K, wp, panels, op, n, b);
    return out;
  }
#endif
#ifdef KVSERVE_LINEAR_AVX2
  linear_with<linear_tile::Avx2>(xp, ldx, rows, K, wp, panels, op, n, b);
#endif
  return out;
}
