// 256-bit float helpers that several kernel files share, the AVX-512 ones among them. They sit
// in an anonymous namespace: every file compiles its own copy for its own target, so the linker
// cannot keep an AVX-512 copy for the AVX2 files' callers (see lowbit_tile.h). No torch or
// standard-library templates here for the same reason.
#pragma once

#include <immintrin.h>

namespace {

// the sum of a vector's 8 lanes
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// exp(x) for x <= 0 (softmax inputs after subtracting the max; sigmoid, tanh), 8 lanes:
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by the degree-7 polynomial of the Cephes library's
// expf, then times 2^n through the exponent bits. Within ~2 ulp of expf; glibc's scalar expf
// cost more than the rest of a decode step's attention.
inline __m256 exp_neg(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // keeps 2^n a normal float; exp < 2e-38
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  // a plain array, not a braced list: std::initializer_list is a template (see above)
  const float coeffs[] = {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                          1.6666665459e-1f, 5.0000001201e-1f};
  for (float c : coeffs) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

}  // namespace
