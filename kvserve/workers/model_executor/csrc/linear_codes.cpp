// The fp32 linear layer with its weights kept as the block codes they were decoded from.
//
// A GGUF checkpoint's weights are quantized in blocks of 32 inputs: Q4_1 keeps a scale d, an
// offset m and 4-bit codes q (w = d q + m), Q8_0 a scale and 8-bit signed codes (w = d q). Loaded
// as fp32, every weight is still exactly fma(d, q, m) for its block's d and m, so the codes hold
// the same numbers in 0.75 or 1.125 bytes instead of 4. `pack_linear_weight_codes` finds d, m
// and q for every block and keeps them only where fma(d, q, m) gives back every fp32 weight bit
// for bit, compared as bits (a -0 never comes back from fma(d, 0, m): such a weight stays fp32).
// `linear_codes` decodes the codes into `linear`'s fp32 panel values and runs `linear`'s
// multiply-add chains over them: for up to 4 rows (decode steps) 16 weights at a time in a
// register, for up to 8 a block at a time into L1, both with the accumulators in registers, for
// more a whole panel at a time into L2, then `linear`'s own register tiles. Same values, same chains: the output equals `linear`'s bit for bit, at
// every row count. What changes is the bytes a step reads (SmolLM2: 115 MB instead of 538), and
// batch-1 decode is bound by reading the weights once.
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "linear_tile.h"

using linear_tile::Isa;
using linear_tile::kNR;

namespace {

constexpr int64_t kBlock = 32;  // inputs per code block (GGUF's QK4_1 and QK8_0)
// a panel's block: d [48] fp32, m [48] fp32, then the codes of its 32 inputs x 48 outputs:
// 4-bit: 16 input pairs x 48 bytes (input 2i in the low nibble, 2i + 1 in the high);
// 8-bit: 32 inputs x 48 signed bytes
constexpr int64_t kHeader = 2 * kNR * 4;
constexpr int64_t kBytes4 = kHeader + kBlock / 2 * kNR;
constexpr int64_t kBytes8 = kHeader + kBlock * kNR;
template <typename I>
constexpr int64_t kLanes = kNR / I::kJ;  // floats per vector

uint32_t bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

// The scales to try for a block whose codes span `levels` steps of `span`, into `out` (6 at
// most): the fp16 value nearest the quotient (GGUF stores d in fp16), the quotient itself, and
// the fp16 values around it; returns how many
int candidate_scales(float span, int levels, float* out) {
  const float d = span / static_cast<float>(levels);
  const c10::Half h(d);
  int count = 0;
  out[count++] = static_cast<float>(h);
  out[count++] = d;
  for (const int step : {-1, 1, -2, 2}) {
    c10::Half near;
    near.x = static_cast<uint16_t>(h.x + step);
    const float f = static_cast<float>(near);
    if (f > 0.0f && f < 65536.0f) out[count++] = f;
  }
  return count;
}

// Codes for v[0..32) with w = fma(d, q, m), every w's bits equal to v's: 4-bit unsigned codes
// with m the block's minimum, or 8-bit signed codes with m = 0. False if no scale tried fits.
bool encode_block(const float* v, int code_bits, float& d_out, float& m_out, int32_t* q_out) {
  const int qmin = code_bits == 4 ? 0 : -127, qmax = code_bits == 4 ? 15 : 127;
#ifdef __AVX512F__
  const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
  const float lo = _mm512_reduce_min_ps(_mm512_min_ps(v0, v1));
  const float hi = _mm512_reduce_max_ps(_mm512_max_ps(v0, v1));
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
  float lo = v[0], hi = v[0], amax = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) {
    lo = std::min(lo, v[i]);
    hi = std::max(hi, v[i]);
    amax = std::max(amax, std::fabs(v[i]));
  }
#endif
  const float m = code_bits == 4 ? lo : 0.0f;
  const float span = code_bits == 4 ? hi - lo : amax;
#ifdef __AVX512F__
  // the usual case, 16 weights at a time: the fp16 scale nearest span / qmax (GGUF's d) and the
  // nearest codes fit; anything else takes the search below
  const float first = static_cast<float>(c10::Half(span / static_cast<float>(qmax)));
  if (span > 0.0f && first > 0.0f) {
    const __m512 d = _mm512_set1_ps(first), inv = _mm512_set1_ps(1.0f / first);
    const __m512 mv = _mm512_set1_ps(m);
    const __m512i lo_q = _mm512_set1_epi32(qmin), hi_q = _mm512_set1_epi32(qmax);
    bool fits = true;
    for (int half = 0; half < 2 && fits; ++half) {
      const __m512 x = half ? v1 : v0;
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_sub_ps(x, mv), inv));
      const __m512 back = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(q), mv);
      const __mmask16 ok = _mm512_cmpeq_epi32_mask(_mm512_castps_si512(back),
                                                   _mm512_castps_si512(x)) &
                           _mm512_cmpge_epi32_mask(q, lo_q) & _mm512_cmple_epi32_mask(q, hi_q);
      fits = ok == 0xFFFF;
      _mm512_storeu_si512(q_out + 16 * half, q);
    }
    if (fits) {
      d_out = first;
      m_out = m;
      return true;
    }
  }
#endif
  float scales[7];
  int count = span > 0.0f ? candidate_scales(span, qmax, scales) : 0;
  scales[count++] = 0.0f;  // a constant block: every code 0
  for (int c = 0; c < count; ++c) {
    const float d = scales[c], inv = d > 0.0f ? 1.0f / d : 0.0f;
    bool fits = true;
    for (int64_t i = 0; i < kBlock && fits; ++i) {
      // the nearest code, or one either side of it (the quotient is rounded too)
      const int q0 = d > 0.0f ? static_cast<int>(std::nearbyint((v[i] - m) * inv)) : 0;
      fits = false;
      for (const int q : {q0, q0 - 1, q0 + 1}) {
        if (q < qmin || q > qmax || bits(std::fma(d, static_cast<float>(q), m)) != bits(v[i]))
          continue;
        q_out[i] = q;
        fits = true;
        break;
      }
    }
    if (fits) {
      d_out = d;
      m_out = m;
      return true;
    }
  }
  return false;
}

// Every block of w [N, K] encoded with `code_bits`, or an empty tensor if one does not fit
at::Tensor pack_with(const float* w, int64_t N, int64_t K, int code_bits) {
  const int64_t panels = (N + kNR - 1) / kNR, blocks = K / kBlock;
  const int64_t bytes = code_bits == 4 ? kBytes4 : kBytes8;
  auto packed = at::zeros({panels, blocks, bytes}, at::TensorOptions().dtype(at::kByte));
  uint8_t* out = packed.data_ptr<uint8_t>();
  std::atomic<bool> fits{true};
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    int32_t q[kNR][kBlock];  // a block's codes, output by output
    for (int64_t p = begin; p < end && fits; ++p) {
      const int64_t n_valid = std::min(kNR, N - p * kNR);
      std::memset(q[n_valid], 0, sizeof(q[0]) * (kNR - n_valid));  // padded outputs: code 0
      for (int64_t b = 0; b < blocks && fits; ++b) {
        uint8_t* block = out + (p * blocks + b) * bytes;
        float* d = reinterpret_cast<float*>(block);
        float* m = d + kNR;
        for (int64_t j = 0; j < n_valid; ++j) {  // padded outputs keep d = m = 0
          if (!encode_block(w + (p * kNR + j) * K + b * kBlock, code_bits, d[j], m[j], q[j])) {
            fits = false;
            break;
          }
        }
        uint8_t* codes = block + kHeader;  // written in memory order
        if (code_bits == 4) {
          for (int64_t i = 0; i < kBlock / 2; ++i)
            for (int64_t j = 0; j < kNR; ++j)
              *codes++ = static_cast<uint8_t>(q[j][2 * i] | (q[j][2 * i + 1] << 4));
        } else {
          for (int64_t i = 0; i < kBlock; ++i)
            for (int64_t j = 0; j < kNR; ++j)
              *codes++ = static_cast<uint8_t>(static_cast<int8_t>(q[j][i]));
        }
      }
    }
  });
  return fits ? packed : at::Tensor();
}

#if defined(__AVX512F__) || defined(KVSERVE_LINEAR_AVX2)

// This thread's buffer for a decoded panel, 64-byte aligned as the tiles' loads need. Kept
// across calls: a fresh one per call (~300 KB, past malloc's mmap threshold) cost a page fault
// per 4 KB of every projection of every step
float* panel_buffer(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats + 16) buffer.resize(floats + 16);
  return reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.data()) + 63) & ~static_cast<uintptr_t>(63));
}

// A block's scales and offsets for its 48 outputs, I::kJ vectors each
template <typename I>
struct BlockScales {
  typename I::V d[I::kJ], m[I::kJ];
  explicit BlockScales(const uint8_t* block) {
    const float* dp = reinterpret_cast<const float*>(block);
    for (int j = 0; j < I::kJ; ++j) {
      d[j] = I::loadu(dp + kLanes<I> * j);
      m[j] = I::loadu(dp + kNR + kLanes<I> * j);
    }
  }
};

// a vector's worth of weights from their codes: fma(d, q, m), the one decode every path runs
template <typename I>
inline typename I::V decode(typename I::V d, typename I::VI q, typename I::V m) {
  return I::fmadd(d, I::to_float(q), m);
}

// Calls f(k, w) for each input k of a block in order, w its 48 decoded weights (4-bit: each
// pair of inputs' codes read once)
template <typename I, typename F>
inline void for_each_input(const uint8_t* block, int64_t bytes, F&& f) {
  const BlockScales<I> s(block);
  const uint8_t* codes = block + kHeader;
  typename I::V w[I::kJ];
  if (bytes == kBytes4) {
    for (int64_t i = 0; i < kBlock / 2; ++i, codes += kNR) {
      typename I::VI c[I::kJ];
      for (int j = 0; j < I::kJ; ++j) {
        c[j] = I::codes_u8(codes + kLanes<I> * j);
        w[j] = decode<I>(s.d[j], I::low4(c[j]), s.m[j]);
      }
      f(2 * i, w);
      for (int j = 0; j < I::kJ; ++j) w[j] = decode<I>(s.d[j], I::high4(c[j]), s.m[j]);
      f(2 * i + 1, w);
    }
  } else {
    for (int64_t k = 0; k < kBlock; ++k, codes += kNR) {
      for (int j = 0; j < I::kJ; ++j)
        w[j] = decode<I>(s.d[j], I::codes_i8(codes + kLanes<I> * j), s.m[j]);
      f(k, w);
    }
  }
}

// One block's fp32 weights [32, 48] (what pack_linear_weight would have written for its 32
// inputs), in the order they lie in memory
template <typename I>
void decode_block(const uint8_t* block, int64_t bytes, float* out) {
  for_each_input<I>(block, bytes, [out](int64_t k, const typename I::V (&w)[I::kJ]) {
    for (int j = 0; j < I::kJ; ++j) I::store(out + k * kNR + kLanes<I> * j, w[j]);
  });
}

// `linear_tile::tile` for one tile of MR <= I::kMR rows, its panel read as blocks: each block
// is decoded into `buffer` [32, 48] (it stays in L1) and multiplied in while the accumulators
// stay in registers, so a few rows (decode steps) never write the whole decoded panel out to L2
// and read it back. The same multiply-adds in the same order, and the same epilogue, as `tile`.
template <typename I, int MR>
void tile_blocks(const float* x, int64_t ldx, const uint8_t* blocks, int64_t nblocks,
                 int64_t bytes, float* buffer, float* out, int64_t ldo, int64_t n_valid,
                 const float* bias) {
  typename I::V acc[MR][I::kJ];
  linear_tile::zero<I, MR>(acc);
  for (int64_t b = 0; b < nblocks; ++b) {
    decode_block<I>(blocks + b * bytes, bytes, buffer);
    linear_tile::multiply_add<I, MR>(acc, x + b * kBlock, ldx, buffer, kBlock);
  }
  linear_tile::store<I, MR>(acc, out, ldo, n_valid, bias);
}

// `tile_blocks` for up to I::kRegRows rows without the buffer: each vector of weights is
// decoded in a register and multiplied in at once (AVX-512: 4 rows x 3 accumulators, the
// scales, offsets and codes fit its 32 registers). The same multiply-adds in the same order.
template <typename I, int MR>
void tile_registers(const float* x, int64_t ldx, const uint8_t* blocks, int64_t nblocks,
                    int64_t bytes, float* /*buffer*/, float* out, int64_t ldo, int64_t n_valid,
                    const float* bias) {
  typename I::V acc[MR][I::kJ];
  linear_tile::zero<I, MR>(acc);
  for (int64_t b = 0; b < nblocks; ++b) {
    const float* xb = x + b * kBlock;
    for_each_input<I>(blocks + b * bytes, bytes,
                      [&](int64_t k, const typename I::V (&w)[I::kJ]) {
                        linear_tile::multiply_add_input<I, MR>(acc, xb, ldx, k, w);
                      });
  }
  linear_tile::store<I, MR>(acc, out, ldo, n_valid, bias);
}

using BlockTileFn = void (*)(const float*, int64_t, const uint8_t*, int64_t, int64_t, float*,
                             float*, int64_t, int64_t, const float*);

// the tile of MR rows: decoded in registers up to I::kRegRows rows, a block at a time past them
template <typename I, int MR>
constexpr BlockTileFn block_tile() {
  if constexpr (MR <= I::kRegRows) return tile_registers<I, MR>;
  else return tile_blocks<I, MR>;
}

template <typename I, int... MR>
constexpr auto block_tiles(std::integer_sequence<int, MR...>) {
  return std::array<BlockTileFn, sizeof...(MR) + 1>{nullptr, block_tile<I, MR + 1>()...};
}

template <typename I>
void linear_codes_with(const float* xp, int64_t ldx, int64_t rows, int64_t K, const uint8_t* cp,
                       int64_t panels, int64_t blocks, int64_t bytes, float* op, int64_t n,
                       const float* b) {
  static constexpr auto kBlockTiles = block_tiles<I>(std::make_integer_sequence<int, I::kMR>{});
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    float* panel = panel_buffer(K * kNR);
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* codes = cp + p * blocks * bytes;
      const int64_t n0 = p * kNR, n_valid = std::min(kNR, n - n0);
      if (rows <= I::kMR) {  // one tile: decode block by block, in L1
        kBlockTiles[rows](xp, ldx, codes, blocks, bytes, panel, op + n0, n, n_valid,
                          b ? b + n0 : nullptr);
        continue;
      }
      for (int64_t blk = 0; blk < blocks; ++blk)  // many tiles: decode the panel once, in L2
        decode_block<I>(codes + blk * bytes, bytes, panel + blk * kBlock * kNR);
      linear_tile::panel_times_rows<I>(xp, ldx, rows, panel, K, op, n, n0, n_valid, b);
    }
  });
}

#endif

}  // namespace

// w: fp32 [N, K] -> block codes [ceil(N / 48), K / 32, bytes] (uint8), 4-bit codes where every
// block fits them, else 8-bit; an empty tensor where neither gives back w exactly (or K is not
// a multiple of 32): the caller packs the fp32 weight instead
at::Tensor pack_linear_weight_codes(const at::Tensor& w_in) {
  TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_in.dim() == 2,
              "pack_linear_weight_codes: fp32 [N, K]");
  const at::Tensor w = w_in.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  if (K % kBlock != 0 || N == 0) return at::Tensor();
  at::Tensor packed = pack_with(w.data_ptr<float>(), N, K, 4);
  if (!packed.defined()) packed = pack_with(w.data_ptr<float>(), N, K, 8);
  return packed;
}

// x: [rows, K] (dense last dim), packed: pack_linear_weight_codes' -> [rows, n], equal to
// linear(x, pack_linear_weight(w), n, bias) bit for bit
at::Tensor linear_codes(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias) {
  const Isa isa = linear_tile::linear_isa();
  TORCH_CHECK(isa != Isa::kNone, "linear_codes: built without AVX2 or AVX-512");
  const float* b = linear_tile::checked_inputs(x, bias, n, "linear_codes");
  const int64_t rows = x.size(0), K = x.size(1), panels = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) * kBlock == K &&
                  (packed.size(2) == kBytes4 || packed.size(2) == kBytes8) &&
                  n > (panels - 1) * kNR && n <= panels * kNR,
              "linear_codes: block codes [panels, K / 32, bytes] for ", n, " outputs and K = ", K);
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;  // (a chunk that samples nothing: lm_head gets no rows)
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldx = x.stride(0), blocks = packed.size(1), bytes = packed.size(2);
#ifdef __AVX512F__
  if (isa == Isa::kAvx512) {
    linear_codes_with<linear_tile::Avx512>(xp, ldx, rows, K, cp, panels, blocks, bytes, op, n, b);
    return out;
  }
#endif
#ifdef KVSERVE_LINEAR_AVX2
  linear_codes_with<linear_tile::Avx2>(xp, ldx, rows, K, cp, panels, blocks, bytes, op, n, b);
#endif
  return out;
}
