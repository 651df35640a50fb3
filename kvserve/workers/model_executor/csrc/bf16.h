// bf16 <-> fp32 for the kernels that take bf16 tensors (their elements seen as uint16_t bits).
// Widening is exact (the bits shifted up); narrowing rounds to nearest even and turns NaN into
// a quiet NaN, as torch's c10::round_to_nearest_even does, so a kernel's bf16 output is what
// the same fp32 value `.to(torch.bfloat16)` would give. One definition for every kernel.
#pragma once

#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace kvserve_bf16 {

inline float widen(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t narrow(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  return (bits & 0x7fffffffu) > 0x7f800000u
             ? uint16_t{0x7fc0}
             : static_cast<uint16_t>((bits + ((bits >> 16) & 1u) + 0x7fffu) >> 16);
}

#ifdef __AVX512F__

// bf16 [16] at p -> fp32 [16]
inline __m512 widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// fp32 [16] -> bf16 [16]
inline __m256i narrow16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

#endif  // __AVX512F__

}  // namespace kvserve_bf16
