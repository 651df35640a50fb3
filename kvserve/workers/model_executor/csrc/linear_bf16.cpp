// A batch-invariant bf16 linear layer for AVX-512 and AVX2 + FMA CPUs: out = bf16(x W^T + bias),
// W prepacked.
//
// Weights and activations stay bf16 in memory (half the bytes of fp32, which is what bounds a
// batch-1 decode step); each product runs in fp32: every output element is one fp32 fused
// multiply-add chain over k = 0..K-1, in that order, whatever the row count or the tile it lands
// in, then + bias in fp32, then one round-to-nearest-even to bf16 (torch's `.to(torch.bfloat16)`).
// So a row's numbers are the same alone or in a batch of 32, as with the fp32 `linear`.
//
// Why fp32 FMAs rather than vdpbf16ps (AVX512-BF16's bf16 pair dot product, 64 FLOPs an
// instruction against an fp32 FMA's 32): on the Xeon we measured (family 6 model 207, AVX512-BF16
// without AMX) vdpbf16ps issues once per ~2.1 cycles against the FMA's twice per cycle, so its
// peak is about half the fp32 one (~90 against ~180 GFLOP/s a core); a vdpbf16ps kernel over
// these panels ran at ~100 GFLOP/s a core, as oneDNN's bf16 does, against ~175 for this one.
// Widening a bf16 to fp32 is a shift or a mask, 2 integer ops per 32 weights, shared by the rows
// of a tile. The panels are still laid out for vdpbf16ps (k pairs interleaved per output lane),
// so a CPU where it is fast can take a dot-product kernel over the same packing.
//
// On AVX2 (no bf16 instruction at all) this is the same code over 8-lane vectors, chosen at run
// time as `linear` is (`linear_isa`): bf16 costs what fp32 costs in FMAs and reads half its bytes,
// where torch's bf16 matmul there is a scalar loop (~1-2 GFLOP/s). Same chains, so the same bits
// as on AVX-512.
//
// A product of two bf16 values is exact in fp32, so each FMA here equals a multiply then an fp32
// add: the result is reproducible in torch, k by k (tests/test_cpu_linear.py does).
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "linear_tile.h"

using linear_tile::Isa;
using linear_tile::kNR;  // outputs per panel: 3 AVX-512 vectors of fp32, 6 AVX2 ones

namespace {

constexpr int64_t kPairs = 2;    // k values per packed lane (a vdpbf16ps pair)
constexpr int64_t kRowBlock = 64;  // rows per work item when a batch is split over rows too
constexpr int64_t kPrefetchBytes = 2048;  // ~10 k pairs ahead in a panel
constexpr int kMaxGroups = 4;

#if defined(__AVX512F__) || defined(KVSERVE_LINEAR_AVX2)

// panels per tile for MR rows: small tiles read several panels so that 12-24 independent FMA
// chains hide the FMA latency (4 cycles, 2 per cycle); each output's chain is unchanged
template <typename I>
constexpr int groups_for(int mr) {
  return std::clamp(I::kMR / mr, 1, kMaxGroups);
}

// out[m, g * 48 + :n_valid] = x[m, :] . panel g (+ bias) for MR rows and G panels.
// x: fp32 [MR, K2] (ldx), K2 = 2 * pairs, zero-padded; panels: bf16 [G][pairs, 48, 2] (stride ldp)
template <typename I, int MR, int G>
void tile(const float* x, int64_t ldx, const uint16_t* __restrict__ panels, int64_t ldp,
          int64_t pairs, uint16_t* out, int64_t ldo, int64_t n_valid, const float* bias) {
  constexpr int64_t lanes = kNR / I::kJ;  // fp32 lanes a vector, bf16 pairs a load
  typename I::V acc[MR][G][I::kJ];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < G; ++g)
      for (int j = 0; j < I::kJ; ++j) acc[m][g][j] = I::zero();
  for (int64_t kk = 0; kk < pairs; ++kk) {
    for (int g = 0; g < G; ++g) {
      const uint16_t* w = panels + g * ldp + kk * kNR * kPairs;
      // a weight matrix past the L2 (lm_head's 56 MB) streams from memory at the pace of the
      // FMAs; the hardware prefetcher alone left 8-32 row tiles waiting on it (~1.4x slower)
      const char* ahead = reinterpret_cast<const char*>(w) + kPrefetchBytes;
      for (int j = 0; j < 3; ++j) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      for (int j = 0; j < I::kJ; ++j) {
        const typename I::VI v = I::load_pairs(w + lanes * kPairs * j);
        // k = 2 kk: the low halves, shifted up, are the fp32 values; then k = 2 kk + 1, the
        // high halves with the low bits cleared
        const typename I::V we = I::even(v), wo = I::odd(v);
        for (int m = 0; m < MR; ++m)
          acc[m][g][j] = I::fmadd(I::set1(x[m * ldx + 2 * kk]), we, acc[m][g][j]);
        for (int m = 0; m < MR; ++m)
          acc[m][g][j] = I::fmadd(I::set1(x[m * ldx + 2 * kk + 1]), wo, acc[m][g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < I::kJ; ++j) {
      const int64_t left = std::clamp<int64_t>(n_valid - g * kNR - lanes * j, 0, lanes);
      if (left == 0) continue;
      const float* b = bias ? bias + g * kNR + lanes * j : nullptr;
      for (int m = 0; m < MR; ++m)
        I::store_bf16_plus(out + m * ldo + g * kNR + lanes * j, acc[m][g][j], b, left);
    }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, int64_t, uint16_t*,
                        int64_t, int64_t, const float*);

template <typename I, int MR, int G>
constexpr TileFn tile_or_null() {
  if constexpr (G <= groups_for<I>(MR)) return tile<I, MR, G>;
  else return nullptr;
}

template <typename I, int MR>
constexpr std::array<TileFn, kMaxGroups + 1> row_of_tiles() {
  return {nullptr, tile_or_null<I, MR, 1>(), tile_or_null<I, MR, 2>(), tile_or_null<I, MR, 3>(),
          tile_or_null<I, MR, 4>()};
}

// tiles<I>()[mr][g]: mr rows by g panels (nullptr where g > groups_for(mr))
template <typename I, int... MR>
constexpr auto tiles(std::integer_sequence<int, MR...>) {
  return std::array<std::array<TileFn, kMaxGroups + 1>, sizeof...(MR) + 1>{
      std::array<TileFn, kMaxGroups + 1>{}, row_of_tiles<I, MR + 1>()...};
}

// x: fp32 [rows, K2]; packed: bf16 panels; out: bf16 [rows, n]
template <typename I>
void linear_bf16_with(const float* xp, int64_t rows, int64_t K2, const uint16_t* wp,
                      int64_t panels, int64_t pairs, uint16_t* op, int64_t n, const float* b) {
  static constexpr auto kTiles = tiles<I>(std::make_integer_sequence<int, I::kMR>{});
  const int64_t ldp = pairs * kNR * kPairs;  // one panel, in bf16 elements
  // work items: (row block, panel); a thread's share is a run of panels of one row block or more.
  // Panel-outer inside a run: a panel stays in cache while every row tile of the block reads it
  const int64_t row_blocks = (rows + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, row_blocks * panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end;) {
      const int64_t rb = item / panels, p_begin = item % panels;
      const int64_t p_end = std::min(panels, p_begin + (end - item));
      const int64_t r0 = rb * kRowBlock, r1 = std::min(rows, r0 + kRowBlock);
      const int group = groups_for<I>(static_cast<int>(std::min<int64_t>(I::kMR, r1 - r0)));
      for (int64_t p = p_begin; p < p_end; p += group) {
        const int64_t g = std::min<int64_t>(group, p_end - p);
        const int64_t n0 = p * kNR, n_valid = std::min(g * kNR, n - n0);
        for (int64_t m0 = r0; m0 < r1; m0 += I::kMR) {
          const int64_t mr = std::min<int64_t>(I::kMR, r1 - m0);
          kTiles[mr][g](xp + m0 * K2, K2, wp + p * ldp, ldp, pairs, op + m0 * n + n0, n, n_valid,
                        b ? b + n0 : nullptr);
        }
      }
      item += p_end - p_begin;
    }
  });
}

#endif

// bf16 [rows, K] (ldx) -> fp32 [rows, K2], zero past K (exact)
void widen_rows(const uint16_t* x, int64_t ldx, int64_t rows, int64_t K, int64_t K2, float* out) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* src = x + r * ldx;
      float* dst = out + r * K2;
      for (int64_t k = 0; k < K; ++k) dst[k] = kvserve_bf16::widen(src[k]);
      for (int64_t k = K; k < K2; ++k) dst[k] = 0.0f;
    }
  });
}

}  // namespace

bool bf16_linear_available() { return linear_tile::linear_isa() != Isa::kNone; }

// w: [N, K] (bf16, or a float type rounded to bf16) -> bf16 panels
// [ceil(N / 48), ceil(K / 2), 48, 2]:
// panel p, pair kk, lane n holds (W[48 p + n, 2 kk], W[48 p + n, 2 kk + 1]), zero past N and K
at::Tensor pack_linear_weight_bf16(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && at::isFloatingType(w.scalar_type()),
              "pack_linear_weight_bf16: a float [N, K] weight");
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kNR - 1) / kNR, pairs = (K + 1) / 2;
  auto padded = at::zeros({panels * kNR, pairs * kPairs}, w.options().dtype(at::kBFloat16));
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  return padded.view({panels, kNR, pairs, kPairs}).permute({0, 2, 1, 3}).contiguous();
}

// x: bf16 [rows, K] (dense last dim), packed: bf16 [panels, ceil(K / 2), 48, 2] -> bf16 [rows, n].
// The panels keep ceil(K / 2), not K: an x one column short of an even K passes the check
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
const Isa isa = linear_tile::linear_isa();
  TORCH_CHECK(isa != Isa::kNone, "linear_bf16: built without AVX2 or AVX-512");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "linear_bf16: bf16 x [rows, K] with a dense last dim");
  const int64_t rows = x.size(0), K = x.size(1), pairs = (K + 1) / 2, panels = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.dim() == 4 && packed.size(1) == pairs && packed.size(2) == kNR &&
                  packed.size(3) == kPairs && n > (panels - 1) * kNR && n <= panels * kNR,
              "linear_bf16: packed bf16 weight [panels, ceil(K / 2), 48, 2] for ", n,
              " outputs and K = ", K);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 64 == 0,
              "linear_bf16: packed weight must start on a 64-byte boundary "
              "(pack_linear_weight_bf16's)");
  at::Tensor bias32;
  if (bias.has_value()) {
    TORCH_CHECK(at::isFloatingType(bias->scalar_type()) && bias->numel() == n,
                "linear_bf16: bias [n]");
    bias32 = bias->to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  }
  auto out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const int64_t K2 = pairs * kPairs;
  auto x32 = at::empty({rows, K2}, x.options().dtype(at::kFloat));
  widen_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), rows, K, K2,
             x32.data_ptr<float>());
  const float* xp = x32.data_ptr<float>();
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
#ifdef __AVX512F__
  if (isa == Isa::kAvx512) {
    linear_bf16_with<linear_tile::Avx512>(xp, rows, K2, wp, panels, pairs, op, n, b);
    return out;
  }
#endif
#ifdef KVSERVE_LINEAR_AVX2
  linear_bf16_with<linear_tile::Avx2>(xp, rows, K2, wp, panels, pairs, op, n, b);
#endif
  return out;
}
