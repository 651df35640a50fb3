// The Python face of kvserve's CPU kernels (workers/cpu_kernels.py builds and loads them).
#include <torch/extension.h>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin);
bool linear_available();
at::Tensor pack_linear_weight(const at::Tensor& w);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias);
at::Tensor decode_layer(const at::Tensor& h, const std::vector<at::Tensor>& w,
                        const std::vector<int64_t>& dims, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention: q [seqs, heads, D] -> same");
  m.def("rms_norm", &rms_norm, "x [rows, hidden] -> LlamaRMSNorm(x)");
  m.def("silu_and_mul", &silu_and_mul, "[rows, 2 * inter] -> silu(gate) * up [rows, inter]");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of x [tokens, heads, D] in place");
  m.def("linear_available", &linear_available, "whether `linear` was built (needs AVX-512)");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] -> panels [ceil(N/48), K, 48]");
  m.def("decode_layer", &decode_layer, "h [seqs, hidden] -> h after a decoder layer (decodes)");
  m.def("linear", &linear, "x [rows, K], panels, N, bias -> x W^T + bias [rows, N]");
}
