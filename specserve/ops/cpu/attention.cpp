// Attention of new query rows over the slot KV cache, float32 on CPU: decode (1 row a
// slot), verification (k draft rows) and prefill chunks.
//
// Why a kernel of our own: torch's SDPA on CPU takes its generic "math" path for a few
// query rows (matmul, masked softmax, matmul, with a mask tensor and several temporaries
// per layer): ~270 us per layer call on the 0.5B, about a tenth of a decode step. Here the
// keys a row sees are read once per kv head, for all the query heads that share it.
//
// Every (row, query head) is computed alone from its own causal (and sliding-window) range
// of the cache, with one fixed order of operations, so a row's result does not depend on
// the other rows of the batch: the same batch invariance as the per-row Python path.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

// [sum(a[0]), ..., sum(a[7])]: eight dot-product partials reduced into one vector
inline __m256 reduce8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // h0 = [a0 a1 a2 a3 (low halves) | a0 a1 a2 a3 (high halves)], h1 likewise for a4..a7
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}

struct Cache {
  const float *k, *v;
  int64_t max_len, kv_heads, D;
  const float* row(const float* base, int64_t slot, int64_t j, int64_t g) const {
    return base + ((slot * max_len + j) * kv_heads + g) * D;
  }
};

// scores[j] = scale * q . k_j for keys lo .. lo + n - 1, 8 keys at a time; in the last
// group the lanes past n read key lo + n - 1 again and are not stored
void scores(const float* q, const Cache& c, int64_t slot, int64_t g, int64_t lo, int64_t n,
            float scale, float* out) {
  const int64_t stride = c.kv_heads * c.D;  // floats from one key to the next
  for (int64_t j0 = 0; j0 < n; j0 += 8) {
    const float* k0 = c.row(c.k, slot, lo + j0, g);
    int64_t step[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) step[u] = std::min<int64_t>(u, n - 1 - j0) * stride;
    __m256 acc[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
    for (int64_t d = 0; d < c.D; d += 8) {
      const __m256 qd = _mm256_loadu_ps(q + d);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u)
        acc[u] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(k0 + step[u] + d), acc[u]);
    }
    alignas(32) float s[8];
    _mm256_store_ps(s, _mm256_mul_ps(reduce8(acc), _mm256_set1_ps(scale)));
    for (int u = 0; u < 8 && j0 + u < n; ++u) out[j0 + u] = s[u];
  }
}

// p[0..n) <- softmax(p), in place
void softmax(float* p, int64_t n) {
  float m = p[0];
  for (int64_t j = 1; j < n; ++j) m = std::max(m, p[j]);
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(p + j), mv));
    _mm256_storeu_ps(p + j, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float tail[8] = {};
  for (int64_t t = j; t < n; ++t) tail[t - j] = p[t];
  const __m256 mask = _mm256_cmp_ps(_mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7),
                                    _mm256_set1_ps(static_cast<float>(n - j)), _CMP_LT_OQ);
  const __m256 e = _mm256_and_ps(exp_neg(_mm256_sub_ps(_mm256_load_ps(tail), mv)), mask);
  _mm256_store_ps(tail, e);
  for (int64_t t = j; t < n; ++t) p[t] = tail[t - j];
  const float inv = 1.0f / hsum(_mm256_add_ps(sum, e));
  for (int64_t t = 0; t < n; ++t) p[t] *= inv;
}

// out[0..D) += sum_j p[j] v_j over keys lo .. lo + n - 1, 64 dims at a time in registers
// (head_dim is a multiple of 64: the Python side checks)
void add_weighted_values(const float* p, const Cache& c, int64_t slot, int64_t g, int64_t lo,
                         int64_t n, float* out) {
  const int64_t stride = c.kv_heads * c.D;
  for (int64_t d0 = 0; d0 < c.D; d0 += 64) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) acc[u] = _mm256_loadu_ps(out + d0 + 8 * u);
    const float* v = c.row(c.v, slot, lo, g) + d0;
    for (int64_t j = 0; j < n; ++j, v += stride) {
      const __m256 pj = _mm256_set1_ps(p[j]);
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) acc[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * u), acc[u]);
    }
#pragma GCC unroll 8
    for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + d0 + 8 * u, acc[u]);
  }
}

// keys per chunk: a chunk's keys (or values) stay in L1 while every query head of the group
// reads them; walking all keys once per head ran at L2 speed
constexpr int64_t CHUNK = 32;

// One query row and one kv head: the `group` query heads that share it, over keys lo..hi.
void attend(const float* q, float* out, const Cache& c, int64_t slot, int64_t g, int64_t lo,
            int64_t hi, int64_t group, float scale, std::vector<float>& p) {
  const int64_t D = c.D, n = hi - lo + 1;
  p.resize(group * n);
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK)
    for (int64_t h = 0; h < group; ++h)
      scores(q + h * D, c, slot, g, lo + j0, std::min(CHUNK, n - j0), scale, &p[h * n + j0]);
  for (int64_t h = 0; h < group; ++h) softmax(&p[h * n], n);
  std::fill(out, out + group * D, 0.0f);
  for (int64_t j0 = 0; j0 < n; j0 += CHUNK)
    for (int64_t h = 0; h < group; ++h)
      add_weighted_values(&p[h * n + j0], c, slot, g, lo + j0, std::min(CHUNK, n - j0), out + h * D);
}

// rows [T, Hkv, D] (each row's Hkv * D floats contiguous) into cache [slots, max_len, Hkv, D]:
// slot i's rows cu[i] .. cu[i+1] at positions starts[i] ... One memcpy a row: per slot, the
// torch ops this took (select, narrow, copy_ for keys and for values) cost ~1 ms of dispatch
// a 4-slot step of the 0.5B (24 layers), ~4 % of it, and a quarter of that with one slot.
void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const std::vector<int64_t>& slots,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& cu) {
  const int64_t max_len = cache.size(1), width = cache.size(2) * cache.size(3);
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(),
              "attend_qkv: caches must be contiguous float32 [slots, max_len, Hkv, D]");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.size(1) * rows.size(2) == width &&
                  rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "attend_qkv: key and value rows must be float32 [T, Hkv, D], each row contiguous");
  const float* src = rows.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t n = cu[i + 1] - cu[i];
    TORCH_CHECK(slots[i] >= 0 && slots[i] < cache.size(0) && starts[i] >= 0 &&
                    starts[i] + n <= max_len,
                "attend_qkv: rows beyond the cache");
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(dst + (slots[i] * max_len + starts[i] + r) * width,
                  src + (cu[i] + r) * rows.stride(0), width * sizeof(float));
  }
}

}  // namespace

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots, const std::vector<int64_t>& cu,
                               torch::Tensor positions, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(),
              "attention: q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == torch::kFloat32 && v_cache.is_contiguous(),
              "attention: caches must be contiguous float32 [slots, max_len, Hkv, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 64 == 0 && k_cache.size(3) == D && H % Hkv == 0,
              "attention: head_dim must be a multiple of 64 and heads a multiple of kv heads");
  TORCH_CHECK(cu.size() == slots.size() + 1 && cu.back() == T && positions.numel() == T &&
                  positions.scalar_type() == torch::kInt64,
              "attention: slots, cu_seqlens and positions do not describe q's rows");
  std::vector<int64_t> row_slot(T);
  for (size_t i = 0; i < slots.size(); ++i)
    for (int64_t r = cu[i]; r < cu[i + 1]; ++r) row_slot[r] = slots[i];
  auto out = torch::empty_like(q);
  const Cache c{k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), k_cache.size(1), Hkv, D};
  const float* qp = q.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const int64_t group = H / Hkv;
  at::parallel_for(0, T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> p;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / Hkv, g = i % Hkv, hi = pos[r];
      TORCH_CHECK(hi < c.max_len, "attention: position beyond the cache");
      const int64_t lo = window > 0 ? std::max<int64_t>(0, hi - window + 1) : 0;
      const int64_t off = (r * H + g * group) * D;
      attend(qp + off, op + off, c, row_slot[r], g, lo, hi, group, static_cast<float>(scale), p);
    }
  });
  return out;
}

// A layer's whole attention from its fused q/k/v projection [T, (H + 2 Hkv) D]: norm q and k
// per head where the model has q/k norms (Gemma 3, Qwen3), rotate them, store k and v at their
// positions in this layer's cache, attend. One call from Python for what took ~15 small ops
// there (slices, views, two norms, two rotaries, the cache writes per slot); the same kernels
// as those ops, so the same bits.
torch::Tensor attend_qkv(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor cos, torch::Tensor sin, const std::vector<int64_t>& slots,
                         const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
                         torch::Tensor positions, int64_t heads, double scale, int64_t window,
                         const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm, double eps) {
  TORCH_CHECK(k_cache.dim() == 4, "attention: caches must be [slots, max_len, Hkv, D]");
  const int64_t T = qkv.size(0), Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * Hkv) * D,
              "attend_qkv: qkv must be [T, (heads + 2 kv heads) * head_dim]");
  TORCH_CHECK(starts.size() == slots.size() && cu.size() == slots.size() + 1 && cu.back() == T,
              "attend_qkv: slots, starts and cu_seqlens do not describe qkv's rows");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "attend_qkv: q and k norms go together");
  auto q = qkv.narrow(1, 0, heads * D).view({T, heads, D});
  auto k = qkv.narrow(1, heads * D, Hkv * D).view({T, Hkv, D});
  if (q_norm) q = rms_norm(q, *q_norm, eps), k = rms_norm(k, *k_norm, eps);
  q = rotary(q, cos, sin), k = rotary(k, cos, sin);
  auto v = qkv.narrow(1, (heads + Hkv) * D, Hkv * D).view({T, Hkv, D});
  store_rows(k, k_cache, slots, starts, cu);
  store_rows(v, v_cache, slots, starts, cu);
  return cached_attention(q, k_cache, v_cache, slots, cu, positions, scale, window);
}
