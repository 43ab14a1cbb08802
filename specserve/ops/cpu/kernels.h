// The functions each kernel file defines and module.cpp exposes to Python.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor q8_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor q4_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor q5_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);
extern const int64_t Q8_RECORD, Q4_RECORD, Q5_RECORD;

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& cu,
                               torch::Tensor positions, double scale, int64_t window);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
