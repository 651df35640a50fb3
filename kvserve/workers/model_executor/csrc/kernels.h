// kvserve's CPU kernels, declared once for bindings.cpp and for the kernels that call others.
#pragma once

#include <ATen/core/Tensor.h>  // not torch/extension.h: 10x slower to compile
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <string>
#include <vector>

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_tables, const at::Tensor& context_lens,
                        double scale, int64_t window, double softcap);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor silu_and_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& x, int64_t heads, const at::Tensor& cos, const at::Tensor& sin);
bool linear_available();
std::string linear_isa();
void set_linear_isa(const std::string& isa);
at::Tensor pack_linear_weight(const at::Tensor& w);
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                  const c10::optional<at::Tensor>& bias);
at::Tensor pack_linear_weight_codes(const at::Tensor& w);
at::Tensor linear_codes(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                        const c10::optional<at::Tensor>& bias);
bool bf16_linear_available();
at::Tensor pack_linear_weight_bf16(const at::Tensor& w);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias);
at::Tensor decode_layer(const at::Tensor& h, const std::vector<at::Tensor>& w,
                        const std::vector<int64_t>& dims, const at::Tensor& cos,
                        const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                        const at::Tensor& context_lens, double scale, double eps,
                        int64_t window);
void apply_token_bitmask_(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& indices,
                          int64_t vocab);
