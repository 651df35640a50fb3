// Elementwise CPU ops fused into one pass each, for the decoder layer on fp32 CPUs. Each one
// replaces 2-6 torch ops (and their launches) with one; see workers/cpu_kernels.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>

namespace {

constexpr int64_t kRowGrain = 16;  // rows per task: tiny batches stay on one thread

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 2 && x.stride(-1) == 1,
              name, ": fp32 rows with a dense last dim");
}

}  // namespace

// x: [rows, hidden] -> weight * x / sqrt(mean(x^2) + eps), as transformers' LlamaRMSNorm
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  TORCH_CHECK(x.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous() &&
              weight.numel() == x.size(1), "rms_norm: x [rows, hidden], fp32 weight [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, hidden}, x.options());
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

// gate_up: [rows, 2 * inter] (gate first) -> silu(gate) * up: [rows, inter]
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = at::empty({rows, inter}, gate_up.options());
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
// cos, sin: [tokens, D].
void rotary_(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin) {
  check_rows(x, "rotary_");
  TORCH_CHECK(x.dim() == 3 && x.stride(1) == x.size(2) && heads <= x.size(1),
              "rotary_: x [tokens, heads, D] with dense heads");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat &&
              cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == x.size(0) &&
              cos.size(1) == x.size(2) && sin.sizes() == cos.sizes(),
              "rotary_: fp32 cos, sin [tokens, D]");
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
