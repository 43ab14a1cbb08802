// The functions each kernel file defines and module.cpp exposes to Python, and the one
// SIMD helper the files share.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <vector>

torch::Tensor q8_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor q4_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor q5_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias);

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& cu,
                               torch::Tensor positions, double scale, int64_t window);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

// the sum of a vector's 8 lanes
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
