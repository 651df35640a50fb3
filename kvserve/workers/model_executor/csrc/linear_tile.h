// The fp32 linear layer's weight panels and register tile, shared by `linear` (panels packed
// from fp32 weights, linear.cpp) and `linear_codes` (panels decoded from block codes, linear_codes.cpp):
// both run the same multiply-add chains over the same values, so their outputs are bit-identical.
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace linear_tile {

// x [rows, K] with a dense last dim, and the fp32 bias [n] or nullptr; `op` names the caller
inline const float* checked_inputs(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                   int64_t n, const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1, op,
              ": fp32 x [rows, K] with a dense last dim");
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
              op, ": fp32 bias [n]");
  return bias->data_ptr<float>();
}

constexpr int64_t kNR = 48;  // outputs per panel: 3 AVX-512 vectors
constexpr int64_t kMR = 8;   // rows per tile: 8 x 3 accumulators fill 24 of the 32 registers

#ifdef __AVX512F__

// acc[m] += x[m, k] * panel[k, :] for k in [0, K), in that order, for MR rows; panel: [K, kNR]
// (x points at the first input the panel's rows belong to)
// acc[m] += x[m, k] * w for MR rows: one input's step of every output's chain; w: 48 weights
template <int MR>
inline void multiply_add_input(__m512 (&acc)[MR][3], const float* x, int64_t ldx, int64_t k,
                               const __m512 (&w)[3]) {
  for (int m = 0; m < MR; ++m) {
    const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
    for (int j = 0; j < 3; ++j) acc[m][j] = _mm512_fmadd_ps(a, w[j], acc[m][j]);
  }
}

template <int MR>
inline void multiply_add(__m512 (&acc)[MR][3], const float* x, int64_t ldx,
                         const float* __restrict__ panel, int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    const float* row = panel + k * kNR;
    const __m512 w[3] = {_mm512_load_ps(row), _mm512_load_ps(row + 16),
                         _mm512_load_ps(row + 32)};
    multiply_add_input(acc, x, ldx, k, w);
  }
}

template <int MR>
inline void zero(__m512 (&acc)[MR][3]) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) acc[m][j] = _mm512_setzero_ps();
}

// out[m, :n_valid] = acc[m] (+ bias) for MR rows
template <int MR>
inline void store(const __m512 (&acc)[MR][3], float* out, int64_t ldo, int64_t n_valid,
                  const float* bias) {
  for (int j = 0; j < 3; ++j) {
    const int64_t left = std::clamp<int64_t>(n_valid - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(out + m * ldo + 16 * j, mask, _mm512_add_ps(acc[m][j], b));
  }
}

// out[m, :n_valid] = x[m, :] . panel (+ bias) for MR rows; panel: [K, kNR]
template <int MR>
void tile(const float* x, int64_t ldx, const float* __restrict__ panel, int64_t K,
          float* out, int64_t ldo, int64_t n_valid, const float* bias) {
  __m512 acc[MR][3];
  zero(acc);
  multiply_add(acc, x, ldx, panel, K);
  store(acc, out, ldo, n_valid, bias);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        const float*);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                    tile<5>, tile<6>, tile<7>, tile<8>};

// out[:, n0:n0 + n_valid] = x . panel (+ bias) for every row of x [rows, K], a tile of up to
// kMR rows at a time; out: [rows, n]
inline void panel_times_rows(const float* x, int64_t ldx, int64_t rows, const float* panel,
                             int64_t K, float* out, int64_t n, int64_t n0, int64_t n_valid,
                             const float* bias) {
  for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
    const int64_t mr = std::min(kMR, rows - m0);
    kTiles[mr](x + m0 * ldx, ldx, panel, K, out + m0 * n + n0, n, n_valid,
               bias ? bias + n0 : nullptr);
  }
}

#endif

}  // namespace linear_tile
