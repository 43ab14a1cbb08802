// RMSNorm and rotary embedding for float32 on CPU, one call each instead of the 5-6 small
// torch ops they take in Python (each a few microseconds of dispatch: ~10 ms of a 0.5B
// decode step over its 24 layers). Every row is computed alone, in a fixed order, so the
// result does not depend on the batch.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

#include "kernels.h"

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  w.is_contiguous() && w.numel() == D && D % 8 == 0,
              "rms_norm: float32 x [..., D] and weight [D], D a multiple of 8");
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* v = xp + r * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 a = _mm256_loadu_ps(v + d);
        acc = _mm256_fmadd_ps(a, a, acc);
      }
      const float scale =
          1.0f / std::sqrt(hsum(acc) / static_cast<float>(D) + static_cast<float>(eps));
      const __m256 sv = _mm256_set1_ps(scale);
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(v + d), sv);
        _mm256_storeu_ps(yp + r * D + d, _mm256_mul_ps(a, _mm256_loadu_ps(wp + d)));
      }
    }
  });
  return y;
}

// NeoX rotary: x [T, H, D], cos/sin [T, D] (halves repeated) ->
//   y1 = x1 cos1 - x2 sin1,  y2 = x2 cos2 + x1 sin2
torch::Tensor rotary(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  x = x.contiguous(), cos = cos.contiguous(), sin = sin.contiguous();
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 3 &&
                  cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32 &&
                  cos.numel() == x.size(0) * x.size(2) && sin.numel() == cos.numel(),
              "rotary: float32 x [T, H, D] and cos/sin [T, D]");
  const int64_t T = x.size(0), H = x.size(1), D = x.size(2), half = D / 2;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T * H, std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)),
                   [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float *v = xp + i * D, *c = cp + (i / H) * D, *s = sp + (i / H) * D;
      float* o = yp + i * D;
      for (int64_t d = 0; d < half; ++d) {
        o[d] = v[d] * c[d] + (-v[d + half]) * s[d];
        o[d + half] = v[d + half] * c[d + half] + v[d] * s[d + half];
      }
    }
  });
  return y;
}
