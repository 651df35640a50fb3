// The Python face of kvserve's CPU kernels (workers/cpu_kernels.py builds and loads them).
#include <torch/extension.h>  // pybind11: only the bindings need it

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention (fp32 or bf16): q [seqs, heads, D] -> same");
  m.def("rms_norm", &rms_norm, "x [rows, hidden] -> LlamaRMSNorm(x), fp32 or bf16");
  m.def("silu_and_mul", &silu_and_mul, "[rows, 2 * inter] -> silu(gate) * up [rows, inter], fp32 or bf16");
  m.def("rotary_", &rotary_, "rotate the first `heads` heads of x [tokens, heads, D] in place, fp32 or bf16");
  m.def("linear_available", &linear_available, "whether `linear` was built (needs AVX-512)");
  m.def("pack_linear_weight", &pack_linear_weight, "W [N, K] -> panels [ceil(N/48), K, 48]");
  m.def("decode_layer", &decode_layer, "h [seqs, hidden] -> h after a decoder layer (decodes), fp32 or bf16");
  m.def("linear", &linear, "x [rows, K], panels, N, bias -> x W^T + bias [rows, N]");
  m.def("bf16_linear_available", &bf16_linear_available,
        "whether `linear_bf16` was built (needs AVX-512)");
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16,
        "W [N, K] -> bf16 panels [ceil(N/48), ceil(K/2), 48, 2] (k pairs per output lane)");
  m.def("linear_bf16", &linear_bf16,
        "bf16 x [rows, K], bf16 panels, N, bias -> bf16(x W^T + bias) [rows, N], fp32 sums");
}
