// The fp32 linear layer's weight panels and register tile, shared by `linear` (panels packed
// from fp32 weights, linear.cpp) and `linear_codes` (panels decoded from block codes, linear_codes.cpp):
// both run the same multiply-add chains over the same values, so their outputs are bit-identical.
//
// Two instruction sets, one panel layout: AVX-512 (a panel row is 3 vectors of 16) and AVX2 + FMA
// (6 vectors of 8), chosen at run time (`linear_isa`). Every output is the same chain of fused
// multiply-adds over k = 0..K-1 in either, lane by lane, so the two give the same bits; what
// differs is how many rows a register tile holds (AVX2 has 16 vector registers, AVX-512 32).
#pragma once

#include <ATen/core/Tensor.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#include "bf16.h"

#if defined(__AVX2__) && defined(__FMA__)
#define KVSERVE_LINEAR_AVX2 1
#endif
#if defined(__AVX512F__) || defined(KVSERVE_LINEAR_AVX2)
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

constexpr int64_t kNR = 48;  // outputs per panel: 3 AVX-512 vectors, 6 AVX2 ones

// The instruction sets the kernels were built with, and the one `linear`, `linear_codes`,
// `linear_bf16` and the bf16 elementwise ops run: the best built and on this CPU, unless one was
// forced (`set_linear_isa`: tests, and KVSERVE_CPU_ISA), kNone included, which is what a CPU with
// neither (Arm, old x86) runs: torch's ops in their place
enum class Isa { kNone = 0, kAvx2 = 1, kAvx512 = 2 };

inline std::optional<Isa>& forced_isa() {
  static std::optional<Isa> isa;  // empty: the best this build and CPU have
  return isa;
}

inline bool cpu_has(Isa isa) {
  __builtin_cpu_init();
  if (isa == Isa::kAvx512) return __builtin_cpu_supports("avx512f");
  if (isa == Isa::kAvx2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return true;
}

inline bool built_with(Isa isa) {
#ifdef __AVX512F__
  if (isa == Isa::kAvx512) return true;
#endif
#ifdef KVSERVE_LINEAR_AVX2
  if (isa == Isa::kAvx2) return true;
#endif
  return isa == Isa::kNone;
}

inline Isa linear_isa() {
  if (forced_isa()) return *forced_isa();
  for (const Isa isa : {Isa::kAvx512, Isa::kAvx2})
    if (built_with(isa) && cpu_has(isa)) return isa;
  return Isa::kNone;
}

#ifdef __AVX512F__
struct Avx512 {
  using V = __m512;
  static constexpr int kJ = kNR / 16;  // vectors per panel row
  static constexpr int kMR = 8;        // rows per tile: 8 x 3 accumulators of 32 registers
  static constexpr int kRegRows = 4;   // rows a code tile decodes in registers (linear_codes)
  using VI = __m512i;
  static V load(const float* p) { return _mm512_load_ps(p); }
  static V loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_store_ps(p, v); }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V zero() { return _mm512_setzero_ps(); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  // a vector's worth of block codes (16 bytes), widened to int32: unsigned, or signed
  static VI codes_u8(const uint8_t* c) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  }
  static VI codes_i8(const uint8_t* c) {
    return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c)));
  }
  static VI low4(VI c) { return _mm512_and_si512(c, _mm512_set1_epi32(0xF)); }
  static VI high4(VI c) { return _mm512_srli_epi32(c, 4); }
  static V to_float(VI q) { return _mm512_cvtepi32_ps(q); }
  // out[:left] = acc + bias[:left] (bias nullptr: 0), left in [0, 16]
  static void store_plus(float* out, V acc, const float* bias, int64_t left) {
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const V b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out, mask, _mm512_add_ps(acc, b));
  }
  // linear_bf16: a vector's worth of (k, k + 1) bf16 pairs (64 bytes), and each half as fp32
  static VI load_pairs(const uint16_t* p) { return _mm512_load_si512(p); }
  static V even(VI v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
  static V odd(VI v) {
    const VI high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
    return _mm512_castsi512_ps(_mm512_and_si512(v, high));
  }
  // out[:left] = bf16(acc + bias[:left])
  static void store_bf16_plus(uint16_t* out, V acc, const float* bias, int64_t left) {
    const __mmask16 mask = static_cast<__mmask16>((1u << left) - 1u);
    const V b = bias ? _mm512_maskz_loadu_ps(mask, bias) : _mm512_setzero_ps();
    _mm256_mask_storeu_epi16(out, mask, kvserve_bf16::narrow16(_mm512_add_ps(acc, b)));
  }
};
#endif

#ifdef KVSERVE_LINEAR_AVX2
struct Avx2 {
  using V = __m256;
  static constexpr int kJ = kNR / 8;
  static constexpr int kMR = 2;       // 2 x 6 accumulators, a weight and 2 inputs of 16 registers
  static constexpr int kRegRows = 1;
  using VI = __m256i;
  static V load(const float* p) { return _mm256_load_ps(p); }
  static V loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_store_ps(p, v); }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V zero() { return _mm256_setzero_ps(); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static VI codes_u8(const uint8_t* c) {  // 8 bytes
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  }
  static VI codes_i8(const uint8_t* c) {
    return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c)));
  }
  static VI low4(VI c) { return _mm256_and_si256(c, _mm256_set1_epi32(0xF)); }
  static VI high4(VI c) { return _mm256_srli_epi32(c, 4); }
  static V to_float(VI q) { return _mm256_cvtepi32_ps(q); }
  static __m256i lanes_below(int64_t left) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static void store_plus(float* out, V acc, const float* bias, int64_t left) {
    const __m256i mask = lanes_below(left);
    const V b = bias ? _mm256_maskload_ps(bias, mask) : _mm256_setzero_ps();
    _mm256_maskstore_ps(out, mask, _mm256_add_ps(acc, b));
  }
  static VI load_pairs(const uint16_t* p) {  // 32 bytes
    return _mm256_load_si256(reinterpret_cast<const __m256i*>(p));
  }
  static V even(VI v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
  static V odd(VI v) {
    const VI high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    return _mm256_castsi256_ps(_mm256_and_si256(v, high));
  }
  static void store_bf16_plus(uint16_t* out, V acc, const float* bias, int64_t left) {
    const V b = bias ? _mm256_maskload_ps(bias, lanes_below(left)) : _mm256_setzero_ps();
    const __m128i h = kvserve_bf16::narrow8(_mm256_add_ps(acc, b));
    if (left == 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), h);
      return;
    }
    alignas(16) uint16_t all[8];  // no 16-bit masked store in AVX2
    _mm_store_si128(reinterpret_cast<__m128i*>(all), h);
    std::memcpy(out, all, 2 * left);
  }
};
#endif

// acc[m] += x[m, k] * w for MR rows: one input's step of every output's chain; w: 48 weights
template <typename I, int MR>
inline void multiply_add_input(typename I::V (&acc)[MR][I::kJ], const float* x, int64_t ldx,
                               int64_t k, const typename I::V (&w)[I::kJ]) {
  for (int m = 0; m < MR; ++m) {
    const typename I::V a = I::set1(x[m * ldx + k]);
    for (int j = 0; j < I::kJ; ++j) acc[m][j] = I::fmadd(a, w[j], acc[m][j]);
  }
}

// acc[m] += x[m, k] * panel[k, :] for k in [0, K), in that order, for MR rows; panel: [K, kNR]
// (x points at the first input the panel's rows belong to)
template <typename I, int MR>
inline void multiply_add(typename I::V (&acc)[MR][I::kJ], const float* x, int64_t ldx,
                         const float* __restrict__ panel, int64_t K) {
  for (int64_t k = 0; k < K; ++k) {
    const float* row = panel + k * kNR;
    typename I::V w[I::kJ];
    for (int j = 0; j < I::kJ; ++j) w[j] = I::load(row + j * (kNR / I::kJ));
    multiply_add_input<I, MR>(acc, x, ldx, k, w);
  }
}

template <typename I, int MR>
inline void zero(typename I::V (&acc)[MR][I::kJ]) {
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < I::kJ; ++j) acc[m][j] = I::zero();
}

// out[m, :n_valid] = acc[m] (+ bias) for MR rows
template <typename I, int MR>
inline void store(const typename I::V (&acc)[MR][I::kJ], float* out, int64_t ldo,
                  int64_t n_valid, const float* bias) {
  constexpr int64_t lanes = kNR / I::kJ;
  for (int j = 0; j < I::kJ; ++j) {
    const int64_t left = std::clamp<int64_t>(n_valid - lanes * j, 0, lanes);
    for (int m = 0; m < MR; ++m)
      I::store_plus(out + m * ldo + lanes * j, acc[m][j], bias ? bias + lanes * j : nullptr,
                    left);
  }
}

// out[m, :n_valid] = x[m, :] . panel (+ bias) for MR rows; panel: [K, kNR]
template <typename I, int MR>
void tile(const float* x, int64_t ldx, const float* __restrict__ panel, int64_t K,
          float* out, int64_t ldo, int64_t n_valid, const float* bias) {
  typename I::V acc[MR][I::kJ];
  zero<I, MR>(acc);
  multiply_add<I, MR>(acc, x, ldx, panel, K);
  store<I, MR>(acc, out, ldo, n_valid, bias);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        const float*);

template <typename I, int... MR>
constexpr auto tiles(std::integer_sequence<int, MR...>) {
  return std::array<TileFn, sizeof...(MR) + 1>{nullptr, tile<I, MR + 1>...};
}

// out[:, n0:n0 + n_valid] = x . panel (+ bias) for every row of x [rows, K], a tile of up to
// I::kMR rows at a time; out: [rows, n]
template <typename I>
inline void panel_times_rows(const float* x, int64_t ldx, int64_t rows, const float* panel,
                             int64_t K, float* out, int64_t n, int64_t n0, int64_t n_valid,
                             const float* bias) {
  static constexpr auto kTiles = tiles<I>(std::make_integer_sequence<int, I::kMR>{});
  for (int64_t m0 = 0; m0 < rows; m0 += I::kMR) {
    const int64_t mr = std::min<int64_t>(I::kMR, rows - m0);
    kTiles[mr](x + m0 * ldx, ldx, panel, K, out + m0 * n + n0, n, n_valid,
               bias ? bias + n0 : nullptr);
  }
}

}  // namespace linear_tile
