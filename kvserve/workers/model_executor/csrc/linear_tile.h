// The fp32 linear layer's weight panels and register tile, shared by `linear` (panels packed
// from fp32 weights, linear.cpp) and `linear_codes` (panels decoded from block codes, linear_codes.cpp):
// both run the same multiply-add chains over the same values, so their outputs are bit-identical.
#pragma once

#include <algorithm>
#include <cstdint>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace linear_tile {

constexpr int64_t kNR = 48;  // outputs per panel: 3 AVX-512 vectors
constexpr int64_t kMR = 8;   // rows per tile: 8 x 3 accumulators fill 24 of the 32 registers

#ifdef __AVX512F__

// out[m, :n_valid] = x[m, :] . panel (+ bias) for MR rows; panel: [K, kNR]
template <int MR>
void tile(const float* x, int64_t ldx, const float* __restrict__ panel, int64_t K,
          float* out, int64_t ldo, int64_t n_valid, const float* bias) {
  __m512 acc[MR][3];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 3; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kNR;
    const __m512 w0 = _mm512_load_ps(w), w1 = _mm512_load_ps(w + 16), w2 = _mm512_load_ps(w + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512 a = _mm512_set1_ps(x[m * ldx + k]);
      acc[m][0] = _mm512_fmadd_ps(a, w0, acc[m][0]);
      acc[m][1] = _mm512_fmadd_ps(a, w1, acc[m][1]);
      acc[m][2] = _mm512_fmadd_ps(a, w2, acc[m][2]);
    }
  }
  for (int j = 0; j < 3; ++j) {
    const int64_t left = std::clamp<int64_t>(n_valid - 16 * j, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + 16 * j) : _mm512_setzero_ps();
    for (int m = 0; m < MR; ++m)
      _mm512_mask_storeu_ps(out + m * ldo + 16 * j, mask, _mm512_add_ps(acc[m][j], b));
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        const float*);
constexpr TileFn kTiles[kMR + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>,
                                    tile<5>, tile<6>, tile<7>, tile<8>};

#endif

}  // namespace linear_tile
