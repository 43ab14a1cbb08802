// The functions each kernel file defines and module.cpp exposes to Python (and simd.h, the
// SIMD helpers the files share).
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "simd.h"

torch::Tensor lowbit_linear(torch::Tensor x, const std::vector<torch::Tensor>& records,
                            const std::vector<int64_t>& kinds, const std::vector<int64_t>& n_outs,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& out);
// the low-bit kernels' instruction set: "avx2" or "avx512vnni" ('' asks; "auto" = the best)
std::string lowbit_isa(const std::string& want);
// true where that instruction set is AVX-512 (attention.cpp then runs its 512-bit tasks)
bool lowbit_wide();
// VNNI calls of this many rows or more pair tiles per 512-bit vector (0 asks; > 0 sets it)
int64_t lowbit_pair_rows(int64_t rows);

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
                               torch::Tensor positions, double scale, int64_t window);
torch::Tensor attend_qkv(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor cos, torch::Tensor sin, const std::vector<int64_t>& slots,
                         const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
                         torch::Tensor positions, int64_t heads, double scale, int64_t window,
                         const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm, double eps);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor w,
                                        double eps);
torch::Tensor gated(torch::Tensor gate_up, bool silu);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_softmax(
    torch::Tensor logits, int64_t k);
