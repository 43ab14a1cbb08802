// The functions each kernel file defines and module.cpp exposes to Python, and the SIMD
// helpers the files share.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <string>
#include <vector>

torch::Tensor lowbit_linear(torch::Tensor x, const std::vector<torch::Tensor>& records,
                            const std::vector<int64_t>& kinds, const std::vector<int64_t>& n_outs,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& out);
// the low-bit kernels' instruction set: "avx2" or "avx512vnni" ('' asks; "auto" = the best)
std::string lowbit_isa(const std::string& want);

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& cu,
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

// the sum of a vector's 8 lanes
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max; sigmoid, tanh), 8 lanes: x = n ln2 + r with
// |r| <= ln2 / 2, exp(r) by the degree-7 polynomial of the Cephes library's expf, then times
// 2^n through the exponent bits. Within ~2 ulp of expf; glibc's scalar expf cost more than
// the rest of a decode step's attention.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // keeps 2^n a normal float; exp < 2e-38
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
