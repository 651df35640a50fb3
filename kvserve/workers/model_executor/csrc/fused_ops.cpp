// Elementwise CPU ops fused into one pass each, for the decoder layer on fp32 and bf16 CPUs. Each
// one replaces 2-6 torch ops (and their launches) with one; see kvserve/workers/model_executor/cpu_kernels.py.
//
// bf16 (AVX-512 or AVX2 builds): values are widened to fp32 in registers and rounded back to bf16 (round to
// nearest even, torch's `.to(torch.bfloat16)`) exactly where transformers' bf16 code rounds: every
// torch op on bf16 tensors computes in fp32 and rounds its result once. So these give torch's
// numbers bit for bit on this CPU (tests/test_cpu_backend.py checks every finite bf16 input of
// SiLU), which takes three details:
// - RMSNorm's sum of squares is torch's own sum of `x.float().pow(2)`: aten's cascade_sum
//   (SumKernel.cpp) over 8-float vectors, since torch runs its AVX2 reduction kernels on AVX-512
//   CPUs too (REGISTER_DISPATCH leaves AVX-512 out); then / hidden, + eps, 1 / sqrt, in that order.
// - SiLU's exp is the one torch's bf16 SiLU calls, Sleef's 1-ulp expf over 16 floats on AVX-512
//   CPUs, over 8 on AVX2 ones (libtorch_cpu exports both; they agree on every bf16 input), on the
//   elements torch vectorizes (whole groups of 32 or 16, by torch's own CPU capability);
//   std::exp on the rest.
// The 16- and 8-lane versions are one template (`Wide`, `Narrow`), chosen at run time with
// `linear`'s instruction set (`linear_isa`).
// - -ffast-math (see kvserve/workers/model_executor/cpu_kernels.py) would fuse a multiply into the next add, reorder the
//   sums, and turn a division into a reciprocal estimate (vrcp14ps, 1 ulp off at times): `opaque`
//   hides a value from the optimizer and `divide` is an explicit vdivps. The fp32 kernels keep
//   their vectorized, reassociated sums (within fp32 rounding of torch's, not equal).
#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <ATen/Version.h>

#include "bf16.h"
#include "linear_tile.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#ifdef __AVX512F__
extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's Vectorized<float>::exp (AVX-512 kernels)
#endif
#ifdef KVSERVE_LINEAR_AVX2
extern "C" __m256 Sleef_expf8_u10(__m256);  // the same on AVX2 CPUs
#endif

using linear_tile::Isa;

namespace {

constexpr int64_t kRowGrain = 16;  // rows per task: tiny batches stay on one thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.dim() >= 2 && x.stride(-1) == 1,
              name, ": fp32 or bf16 rows with a dense last dim");
}

#ifdef KVSERVE_LINEAR_AVX2  // AVX-512 builds have AVX2 too

// the value, unknown to the optimizer: no fusing or reordering across it
template <typename T>
inline T opaque(T v) {
  asm("" : "+v"(v));
  return v;
}

// a / b correctly rounded: under -ffast-math GCC turns a vector division into a reciprocal
// estimate and a Newton step (vrcp14ps), which is 1 ulp off at times
template <typename V>
inline V divide(V a, V b) {
  V q;
  asm("vdivps %2, %1, %0" : "=v"(q) : "v"(a), "v"(b));
  return q;
}

using kvserve_bf16::narrow;
using kvserve_bf16::widen;

// bf16 rounded through fp32: the value a torch bf16 op leaves, as fp32
inline float round_bf16(float f) { return widen(narrow(f)); }

#ifdef __AVX512F__
struct Wide {  // 16 lanes
  using V = __m512;
  static constexpr int64_t kN = 16;
  static V load(const uint16_t* p) { return kvserve_bf16::widen16(p); }
  static void store(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), kvserve_bf16::narrow16(v));
  }
  static V round(V v) {  // to bf16 and back
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(kvserve_bf16::narrow16(v)), 16));
  }
  static V set1(float v) { return _mm512_set1_ps(v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V neg(V a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.f)); }
  static V exp(V a) { return Sleef_expf16_u10(a); }
};
#endif

struct Narrow {  // 8 lanes
  using V = __m256;
  static constexpr int64_t kN = 8;
  static V load(const uint16_t* p) { return kvserve_bf16::widen8(p); }
  static void store(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), kvserve_bf16::narrow8(v));
  }
  static V round(V v) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(kvserve_bf16::narrow8(v)), 16));
  }
  static V set1(float v) { return _mm256_set1_ps(v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.f)); }
  static V exp(V a) { return Sleef_expf8_u10(a); }
};

constexpr int kLanes = 8;  // torch's Vectorized<float> in its AVX2 sum kernel
using Lanes = __m256;

// squares of x[8 i .. 8 i + 7], each rounded to fp32 (torch's `x.pow(2)` is its own op)
inline Lanes squares(const uint16_t* x, int64_t i) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + kLanes * i));
  const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  return opaque(_mm256_mul_ps(v, v));
}

inline Lanes add(Lanes a, Lanes b) { return opaque(_mm256_add_ps(a, b)); }

int64_t ceil_log2(int64_t x) {
  int64_t bits = 0;
  while ((int64_t{1} << bits) < x) ++bits;
  return bits;
}

// sum(float(x)^2) for a bf16 row of n, in the order of aten's cascade_sum over a contiguous row
// (vectorized_inner_sum -> row_sum -> multi_row_sum, 4 interleaved accumulators, 4 levels)
float torch_sum_of_squares(const uint16_t* x, int64_t n) {
  const int64_t vecs = n / kLanes, size = vecs / 4;  // row_sum's ilp_factor = 4
  constexpr int kLevels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t step = int64_t{1} << power, mask = step - 1;
  Lanes acc[kLevels][4];
  for (auto& level : acc)
    for (auto& a : level) a = _mm256_setzero_ps();
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], squares(x, 4 * i + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        acc[j][k] = add(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = _mm256_setzero_ps();
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], squares(x, 4 * i + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) acc[0][k] = add(acc[0][k], acc[j][k]);
  for (int64_t v = size * 4; v < vecs; ++v) acc[0][0] = add(acc[0][0], squares(x, v));
  for (int k = 1; k < 4; ++k) acc[0][0] = add(acc[0][0], acc[0][k]);
  float total = 0.f;
  for (int64_t k = vecs * kLanes; k < n; ++k) {
    const float v = widen(x[k]);
    total = opaque(total + opaque(v * v));
  }
  alignas(32) float partials[kLanes];
  _mm256_store_ps(partials, acc[0][0]);
  for (float p : partials) total = opaque(total + p);
  return total;
}

template <typename W>
void rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  const auto* in = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const auto e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* xr = in + r * stride;
      uint16_t* orow = o + r * hidden;
      // torch: x * rsqrt(mean(x^2) + eps), mean = sum / hidden, rsqrt = 1 / sqrt
      const float mean = opaque(torch_sum_of_squares(xr, hidden) / static_cast<float>(hidden));
      const float inv = opaque(1.f / opaque(std::sqrt(opaque(mean + e))));
      const typename W::V vinv = W::set1(inv);
      int64_t i = 0;
      for (; i + W::kN <= hidden; i += W::kN) {  // bf16(w * bf16(x * inv))
        const typename W::V y = W::round(W::mul(W::load(xr + i), vinv));
        W::store(orow + i, W::mul(W::load(w + i), y));
      }
      for (; i < hidden; ++i)
        orow[i] = narrow(widen(w[i]) * round_bf16(opaque(widen(xr[i]) * inv)));
    }
  });
}

// the elements of a row torch's bf16 SiLU runs in vectors: whole Vectorized<BFloat16>s, 32 on
// its AVX-512 kernels and 16 on its AVX2 ones (ATEN_CPU_CAPABILITY can choose either)
int64_t torch_vectorized(int64_t n) {
  static const int64_t group = at::get_cpu_capability() == "AVX512" ? 32 : 16;
  return n / group * group;
}

template <typename W>
void silu_and_mul_bf16(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  const auto* in = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  // torch's bf16 SiLU runs Sleef on whole vectors of a row, std::exp on the rest
  const int64_t vectorized = torch_vectorized(inter);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* g = in + r * stride;
      const uint16_t* u = g + inter;
      uint16_t* orow = o + r * inter;
      for (int64_t i = 0; i < vectorized; i += W::kN) {  // bf16(bf16(g / (1 + exp(-g))) * u)
        const typename W::V x = W::load(g + i);
        const typename W::V e = W::exp(W::neg(x));
        const typename W::V s = divide(x, opaque(W::add(W::set1(1.f), opaque(e))));
        W::store(orow + i, W::mul(W::round(s), W::load(u + i)));
      }
      for (int64_t i = vectorized; i < inter; ++i) {
        const float x = widen(g[i]);
        const float s = opaque(x / opaque(1.f + opaque(std::exp(-x))));
        orow[i] = narrow(round_bf16(s) * widen(u[i]));
      }
    }
  });
}

template <typename W>
void rotary_bf16(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t tokens = x.size(0), D = x.size(2), half = D / 2, stride = x.stride(0);
  auto* base = reinterpret_cast<uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* c = reinterpret_cast<const uint16_t*>(cos.data_ptr<at::BFloat16>());
  const auto* s = reinterpret_cast<const uint16_t*>(sin.data_ptr<at::BFloat16>());
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t* ct = c + t * D;
      const uint16_t* st = s + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        uint16_t* v = base + t * stride + h * D;
        // torch: bf16(bf16(x * cos) + bf16(rotate_half(x) * sin)), rotate_half = (-x2, x1)
        int64_t i = 0;
        for (; i + W::kN <= half; i += W::kN) {
          const typename W::V x1 = W::load(v + i), x2 = W::load(v + i + half);
          const typename W::V a = W::add(W::round(W::mul(x1, W::load(ct + i))),
                                         W::round(W::mul(W::neg(x2), W::load(st + i))));
          const typename W::V b = W::add(W::round(W::mul(x2, W::load(ct + i + half))),
                                         W::round(W::mul(x1, W::load(st + i + half))));
          W::store(v + i, a);
          W::store(v + i + half, b);
        }
        for (; i < half; ++i) {
          const float x1 = widen(v[i]), x2 = widen(v[i + half]);
          v[i] = narrow(round_bf16(x1 * widen(ct[i])) + round_bf16(-x2 * widen(st[i])));
          v[i + half] = narrow(round_bf16(x2 * widen(ct[i + half])) +
                               round_bf16(x1 * widen(st[i + half])));
        }
      }
    }
  });
}

#endif  // KVSERVE_LINEAR_AVX2

// Runs f(W{}) with W the vector of the kernels' instruction set (`linear_isa`), or refuses bf16
// where there is none
template <typename F>
void with_bf16_lanes(const char* name, F&& f) {
  const Isa isa = linear_tile::linear_isa();
  TORCH_CHECK(isa != Isa::kNone, name, ": bf16 needs an AVX2 or AVX-512 build");
#ifdef __AVX512F__
  if (isa == Isa::kAvx512) return f(Wide{});
#endif
#ifdef KVSERVE_LINEAR_AVX2
  f(Narrow{});
#endif
}

}  // namespace

// x: [rows, hidden] -> weight * x / sqrt(mean(x^2) + eps), as transformers' LlamaRMSNorm.
// fp32 x, fp32 weight; or bf16 x, bf16 weight (transformers' bf16 rounding points)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && weight.scalar_type() == x.scalar_type() && weight.is_contiguous() &&
              weight.numel() == x.size(1),
              "rms_norm: x [rows, hidden], weight [hidden] of x's dtype");
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, hidden}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    with_bf16_lanes("rms_norm",
                    [&](auto w) { rms_norm_bf16<decltype(w)>(x, weight, eps, out); });
    return out;
  }
  const float* in = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const auto e = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ xr = in + r * stride;
      float* __restrict__ orow = o + r * hidden;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < hidden; ++i) sum += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sum / hidden + e);
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) orow[i] = w[i] * (xr[i] * inv);
    }
  });
  return out;
}

// gate_up: [rows, 2 * inter] (gate first) -> silu(gate) * up: [rows, inter], fp32 or bf16
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
  if (gate_up.scalar_type() == at::kBFloat16) {
    with_bf16_lanes("silu_and_mul",
                    [&](auto w) { silu_and_mul_bf16<decltype(w)>(gate_up, out); });
    return out;
  }
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict__ g = in + r * stride;
      const float* __restrict__ u = g + inter;
      float* __restrict__ orow = o + r * inter;
#pragma omp simd
      for (int64_t i = 0; i < inter; ++i) orow[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// In place on x: [tokens, heads, D] (its first `heads` heads of each row): the half-split
// rotation of transformers' apply_rotary_pos_emb, x * cos + rotate_half(x) * sin.
// cos, sin: [tokens, D], of x's dtype (fp32 or bf16).
void rotary_(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(1) == x.size(2) && heads <= x.size(1),
              "rotary_: x [tokens, heads, D] with dense heads");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type() &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary_: cos, sin [tokens, D] of x's dtype");
  if (x.scalar_type() == at::kBFloat16) {
    with_bf16_lanes("rotary_",
                    [&](auto w) { rotary_bf16<decltype(w)>(x, heads, cos, sin); });
    return;
  }
  const int64_t tokens = x.size(0), D = x.size(2), half = D / 2, stride = x.stride(0);
  float* base = x.data_ptr<float>();
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict__ ct = c + t * D;
      const float* __restrict__ st = s + t * D;
      for (int64_t h = 0; h < heads; ++h) {
        float* __restrict__ v = base + t * stride + h * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = v[i], x2 = v[i + half];
          v[i] = x1 * ct[i] - x2 * st[i];
          v[i + half] = x2 * ct[i + half] + x1 * st[i + half];
        }
      }
    }
  });
}
