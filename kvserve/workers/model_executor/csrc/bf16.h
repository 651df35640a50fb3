// bf16 <-> fp32 for the kernels that take bf16 tensors (their elements seen as uint16_t bits).
// Widening is exact (the bits shifted up); narrowing rounds to nearest even and turns NaN into
// a quiet NaN, as torch's c10::round_to_nearest_even does, so a kernel's bf16 output is what
// the same fp32 value `.to(torch.bfloat16)` would give. One definition for every kernel.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__)
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

#ifdef __AVX2__

// bf16 [8] at p -> fp32 [8]
inline __m256 widen8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// fp32 [8] -> bf16 [8], as narrow16
inline __m128i narrow8(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  // NaN: magnitude above infinity's, as signed int32 (the sign bit cleared)
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i high = _mm256_srli_epi32(
      _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc00000), nan), 16);
  // 32 -> 16 bits: every value is below 2^16, so the saturating pack keeps it; the pack works
  // within 128-bit halves, and the permute puts the two halves' results side by side
  return _mm256_castsi256_si128(
      _mm256_permute4x64_epi64(_mm256_packus_epi32(high, high), 0xD8));
}

#endif  // __AVX2__

}  // namespace kvserve_bf16
