// The Python face of kvserve's CPU kernels (kvserve/workers/model_executor/cpu_kernels.py builds and
// loads them): torch operators in the `kvserve` namespace, called as torch.ops.kvserve.<name>.
// The dispatcher's registration header, not torch/extension.h (pybind11 and Python's headers):
// this file compiles in ~8 s instead of ~28 s, and the first use of the kernels on a new
// machine waits for the build.
#include <torch/library.h>

#include "kernels.h"

TORCH_LIBRARY(kvserve, m) {
  // paged decode attention (fp32 or bf16): q [seqs, heads, D] -> same
  m.def("paged_decode", &paged_decode);
  // x [rows, hidden] -> LlamaRMSNorm(x), fp32 or bf16
  m.def("rms_norm", &rms_norm);
  // [rows, 2 * inter] -> silu(gate) * up [rows, inter], fp32 or bf16
  m.def("silu_and_mul", &silu_and_mul);
  // rotate the first `heads` heads of x [tokens, heads, D] in place, fp32 or bf16
  m.def("rotary_", &rotary_);
  // whether `linear` was built (needs AVX2 + FMA, or AVX-512)
  m.def("linear_available", &linear_available);
  // which instruction set the projections and bf16 elementwise ops run ("avx512", "avx2", "":
  // neither), and forcing one ("none" too) where it is built (tests, KVSERVE_CPU_ISA)
  m.def("linear_isa", &linear_isa);
  m.def("set_linear_isa", &set_linear_isa);
  // W [N, K] -> panels [ceil(N/48), K, 48]
  m.def("pack_linear_weight", &pack_linear_weight);
  // h [seqs, hidden] -> h after a decoder layer (decodes), fp32 or bf16
  m.def("decode_layer", &decode_layer);
  // x [rows, K], panels, N, bias -> x W^T + bias [rows, N]
  m.def("linear", &linear);
  // W [N, K] -> block codes [ceil(N/48), K/32, bytes] (uint8) that give back W exactly, or an
  // empty tensor where W is not a GGUF-style block-quantized weight
  m.def("pack_linear_weight_codes", &pack_linear_weight_codes);
  // x [rows, K], block codes, N, bias -> linear(x, pack_linear_weight(W), N, bias), bit for bit
  m.def("linear_codes", &linear_codes);
  // whether `linear_bf16` runs (AVX2 + FMA, or AVX-512)
  m.def("bf16_linear_available", &bf16_linear_available);
  // W [N, K] -> bf16 panels [ceil(N/48), ceil(K/2), 48, 2] (k pairs per output lane)
  m.def("pack_linear_weight_bf16", &pack_linear_weight_bf16);
  // bf16 x [rows, K], bf16 panels, N, bias -> bf16(x W^T + bias) [rows, N], fp32 sums
  m.def("linear_bf16", &linear_bf16);
  // structured outputs: logits rows `indices` [n] to -inf where bitmask [rows, words] forbids
  m.def("apply_token_bitmask_", &apply_token_bitmask_);
}
