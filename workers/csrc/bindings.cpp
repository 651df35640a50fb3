// The Python face of kvserve's CPU kernels (workers/cpu_kernels.py builds and loads them).
#include <torch/extension.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention: q [seqs, heads, D] -> same");
  m.def("rms_norm", &rms_norm, "x [rows, hidden] -> LlamaRMSNorm(x)");
  m.def("silu_and_mul", &silu_and_mul, "[rows, 2 * inter] -> silu(gate) * up [rows, inter]");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of x [tokens, heads, D] in place");
}
