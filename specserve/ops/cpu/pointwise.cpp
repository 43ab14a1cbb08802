// RMSNorm (alone or after the residual add), the gated MLP's activation, and rotary
// embedding for float32 on CPU, one call each instead of the small torch ops they take in
// Python (each a few microseconds of dispatch, ~100 of them in a 0.5B decode step's 24
// layers). Every row is computed alone, in a fixed order, so the result does not depend on
// the batch.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

// rows per parallel task: about 32K floats, so small batches stay on one thread
int64_t row_grain(int64_t D) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(D, 1)); }

// y = v / rms(v) * w over one row of D floats (D a multiple of 8)
inline void norm_row(const float* v, const float* w, float* y, int64_t D, float eps) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = _mm256_loadu_ps(v + d);
    acc = _mm256_fmadd_ps(a, a, acc);
  }
  const __m256 scale = _mm256_set1_ps(1.0f / std::sqrt(hsum(acc) / static_cast<float>(D) + eps));
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 a = _mm256_mul_ps(_mm256_loadu_ps(v + d), scale);
    _mm256_storeu_ps(y + d, _mm256_mul_ps(a, _mm256_loadu_ps(w + d)));
  }
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w, const char* name) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && w.scalar_type() == torch::kFloat32 &&
                  w.is_contiguous() && w.numel() == D && D % 8 == 0,
              name, ": float32 x [..., D] and weight [D], D a multiple of 8");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  x = x.contiguous();
  check_norm(x, w, "rms_norm");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  auto y = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      norm_row(xp + r * D, wp, yp + r * D, D, static_cast<float>(eps));
  });
  return y;
}

// The residual stream's add and the next norm in one pass: s = x + y, then rms_norm(s).
// Bit-equal to the two ops apart (one float add per element, the same norm_row).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor y, torch::Tensor w,
                                        double eps) {
  x = x.contiguous(), y = y.contiguous();
  check_norm(x, w, "add_rms_norm");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == torch::kFloat32,
              "add_rms_norm: x and y must have the same shape");
  const int64_t D = x.size(-1), rows = D ? x.numel() / D : 0;
  auto sum = torch::empty_like(x), normed = torch::empty_like(x);
  const float *xp = x.data_ptr<float>(), *yp = y.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *sp = sum.data_ptr<float>(), *np = normed.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(D), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* s = sp + r * D;
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(s + d, _mm256_add_ps(_mm256_loadu_ps(xp + r * D + d),
                                              _mm256_loadu_ps(yp + r * D + d)));
      norm_row(s, wp, np + r * D, D, static_cast<float>(eps));
    }
  });
  return {sum, normed};
}

namespace {

// silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1 (no overflow either side)
inline __m256 silu(__m256 g) {
  const __m256 e = exp_neg(_mm256_or_ps(g, _mm256_set1_ps(-0.0f)));  // exp(-|g|)
  const __m256 r = _mm256_div_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  const __m256 positive = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_mul_ps(g, _mm256_blendv_ps(_mm256_mul_ps(e, r), r, positive));
}

// gelu with tanh: g/2 (1 + tanh(y)), y = sqrt(2/pi) (g + 0.044715 g^3). With t = exp(-2|y|),
// 1 + tanh(y) is 2 / (1 + t) for y >= 0 and 2t / (1 + t) below.
inline __m256 gelu_tanh(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 y = _mm256_mul_ps(_mm256_set1_ps(0.7978845608f),
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  const __m256 abs2 = _mm256_mul_ps(_mm256_set1_ps(-2.0f), _mm256_andnot_ps(_mm256_set1_ps(-0.0f), y));
  const __m256 t = exp_neg(abs2);
  const __m256 r = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), t));
  const __m256 positive = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GE_OQ);
  return _mm256_blendv_ps(_mm256_mul_ps(r, t), r, positive);
}

}  // namespace

// A gated MLP's middle: gate_up [..., 2I] (gate, then up) -> act(gate) * up [..., I], with
// act silu (SwiGLU) or tanh-gelu (GeGLU). One pass instead of slicing, act and mul.
torch::Tensor gated(torch::Tensor gate_up, bool use_silu) {
  gate_up = gate_up.contiguous();
  const int64_t two_i = gate_up.size(-1), I = two_i / 2, rows = two_i ? gate_up.numel() / two_i : 0;
  TORCH_CHECK(gate_up.scalar_type() == torch::kFloat32 && I % 8 == 0 && two_i == 2 * I,
              "gated: float32 gate_up [..., 2I], I a multiple of 8");
  auto sizes = gate_up.sizes().vec();
  sizes.back() = I;
  auto out = torch::empty(sizes, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, rows, row_grain(two_i), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float *g = gp + r * two_i, *u = g + I;
      for (int64_t d = 0; d < I; d += 8) {
        const __m256 gv = _mm256_loadu_ps(g + d);
        const __m256 a = use_silu ? silu(gv) : gelu_tanh(gv);
        _mm256_storeu_ps(op + r * I + d, _mm256_mul_ps(a, _mm256_loadu_ps(u + d)));
      }
    }
  });
  return out;
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
  at::parallel_for(0, T * H, row_grain(D), [&](int64_t i0, int64_t i1) {
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

namespace {

// The indices of a row's k largest entries, largest first, the first of tied ones first: a
// vector of 8 is looked at one by one only where one of its entries beats the k-th so far.
std::vector<int64_t> top_entries(const float* x, int64_t V, int64_t k) {
  std::vector<int64_t> top;
  float kth = -INFINITY;  // the k-th largest so far, once there are k
  auto offer = [&](int64_t i) {
    if (std::isnan(x[i]) || (static_cast<int64_t>(top.size()) == k && !(x[i] > kth))) return;
    auto at = top.begin();
    while (at != top.end() && x[*at] >= x[i]) ++at;  // after the ties already in
    top.insert(at, i);
    if (static_cast<int64_t>(top.size()) > k) top.pop_back();
    if (static_cast<int64_t>(top.size()) == k) kth = x[top.back()];
  };
  const int64_t whole = V - V % 8;
  for (int64_t i = 0; i < whole; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    if (_mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(kth), _CMP_GT_OQ)) == 0 &&
        static_cast<int64_t>(top.size()) == k)
      continue;
    for (int64_t j = i; j < i + 8; ++j) offer(j);
  }
  for (int64_t i = whole; i < V; ++i) offer(i);
  return top;
}

}  // namespace

// Each row's k likeliest entries, likeliest first (the first of tied ones first), with their
// softmax probabilities exp(x - max) / sum(exp(x - max)): a draft head asks this of its
// logits at every draft token, its token and the runners-up it may offer beside it, and
// torch's softmax, topk and their conversions to Python cost it more than its LM head did.
// A row without a finite largest entry gets one entry, index 0 at probability 0.
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>> top_softmax(
    torch::Tensor logits, int64_t k) {
  logits = logits.contiguous();
  TORCH_CHECK(logits.scalar_type() == torch::kFloat32 && logits.dim() == 2 && logits.size(1) > 0,
              "top_softmax: float32 logits [N, V], V > 0");
  TORCH_CHECK(k > 0, "top_softmax: k > 0");
  const int64_t N = logits.size(0), V = logits.size(1), whole = V - V % 8;
  k = std::min(k, V);
  std::vector<std::vector<int64_t>> ids(N);
  std::vector<std::vector<double>> probs(N);
  for (int64_t r = 0; r < N; ++r) {
    const float* x = logits.data_ptr<float>() + r * V;
    // the likeliest entry is the row's largest: no pass of its own for it, and a NaN,
    // which top_entries passes over, cannot stand in for it
    const auto top = top_entries(x, V, k);
    const float m = top.empty() ? NAN : x[top.front()];
    if (!std::isfinite(m)) {
      ids[r] = {0}, probs[r] = {0.0};
      continue;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < whole; i += 8)
      acc = _mm256_add_ps(acc, exp_neg(_mm256_sub_ps(_mm256_loadu_ps(x + i), mv)));
    double sum = hsum(acc);
    for (int64_t i = whole; i < V; ++i) sum += std::exp(static_cast<double>(x[i] - m));
    ids[r] = top;
    for (const int64_t i : top) probs[r].push_back(std::exp(static_cast<double>(x[i] - m)) / sum);
  }
  return {ids, probs};
}
