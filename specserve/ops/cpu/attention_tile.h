// The part of cached attention that every instruction set shares, written once for a float
// vector type V: F8 here (256 bits), F16 in attention_avx512.cpp (512 bits). One task is one
// slot's kv head for a block of that slot's query rows (attention.cpp makes the tasks and
// splits them across threads). As with lowbit_tile.h, each file compiles its own copy in an
// anonymous namespace and nothing here uses torch or the standard library's templates.
//
// Scores: the block's keys are walked in chunks of CH, each chunk transposed once into
// kt[d][j] (L1-resident) and shared by every (row, query head) vector of the block that sees
// it: score lane j = scale * (an fma chain over d = 0..D-1 of q[d] kt[d][j]), with the q[d]
// broadcast, so there are no horizontal sums and each kt vector serves up to V::QK_NV query
// vectors (8 rows x 7 heads of the 0.5B share one transpose). Values: out[d] is an fma chain
// over the row's keys in order, up to V::AV_NV heads of a row per value load.
//
// Batch invariance and ISA invariance by construction: a score is one lane's fma chain over
// d, an output one lane's chain over the row's own keys, the softmax works on the row's own
// range with 256-bit code in every file, so neither the other rows of the block nor the
// vector width changes a bit.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

#define ATTN_INLINE inline __attribute__((always_inline))

// What every task of one call reads and writes (attention.cpp fills it).
struct AttnArgs {
  const float* q;  // [T, H, D]
  float* out;      // [T, H, D]
  const float *k, *v;  // caches [slots, max_len, Hkv, D]
  int64_t max_len, kv_heads, heads, D;
  const int64_t *lo, *hi;  // per row: its first and last visible key
  float scale;
};

// One task: kv head g of `slot` for query rows r0 .. r1 - 1 (all of that slot) and query
// heads h0 .. h1 - 1 (all of kv head g's group). An alternative's task (batch.py `branches`)
// has one row, whose own key, `own` (its position), is read from where it is stored, `at`;
// every other task has own = at = -1.
struct AttnTask {
  int64_t slot, g, r0, r1, h0, h1;
  int64_t own = -1, at = -1;
};

// keys per chunk: a chunk's transposed keys (D x CH floats) and values stay in L1 while every
// vector of the task reads them
constexpr int64_t ATTN_CH = 32;

// the scores' scratch of one task: a row-major [rows * heads, width] block, width the task's
// key range rounded out to whole chunks
struct AttnSpan {
  int64_t base, width, hi;  // hi: the last key any row of the task sees
};

// attention_avx512.cpp's copy of attend_task (call only where the CPU has AVX-512F)
void attend_task_avx512(const AttnArgs& a, const AttnTask& t, float* p, float* kt);

namespace {

inline AttnSpan attn_span(const AttnArgs& a, const AttnTask& t) {
  int64_t lo = a.lo[t.r0], hi = a.hi[t.r0];
  for (int64_t r = t.r0 + 1; r < t.r1; ++r) {
    lo = a.lo[r] < lo ? a.lo[r] : lo;
    hi = a.hi[r] > hi ? a.hi[r] : hi;
  }
  const int64_t base = lo / ATTN_CH * ATTN_CH;
  return AttnSpan{base, (hi / ATTN_CH + 1) * ATTN_CH - base, hi};
}

// The task's scratch row of (row r, query head h): its scores from key span.base on
ATTN_INLINE float* scores_of(float* p, const AttnTask& t, AttnSpan s, int64_t r, int64_t h) {
  return p + ((r - t.r0) * (t.h1 - t.h0) + h - t.h0) * s.width;
}

// The first key of kv head g in `cache` (keys of one head are kv_heads * D floats apart)
ATTN_INLINE const float* head_start(const AttnArgs& a, const AttnTask& t, const float* cache) {
  return cache + (t.slot * a.max_len * a.kv_heads + t.g) * a.D;
}

// 256-bit float vectors
struct F8 {
  using T = __m256;
  static constexpr int W = 8;
  static constexpr int QK_NV = 2;  // 8 accumulators + 4 key vectors of 16 registers
  static constexpr int AV_NV = 1;  // a 64-dim slice is 8 accumulators already
  static ATTN_INLINE T load(const float* p) { return _mm256_loadu_ps(p); }
  static ATTN_INLINE void store(float* p, T a) { _mm256_storeu_ps(p, a); }
  static ATTN_INLINE T splat(float v) { return _mm256_set1_ps(v); }
  static ATTN_INLINE T zero() { return _mm256_setzero_ps(); }
  static ATTN_INLINE T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static ATTN_INLINE T mul(T a, T b) { return _mm256_mul_ps(a, b); }
};

// rows r[0..8) of 8 floats each into columns: out[i * ld ..] = (r[0][i], ..., r[7][i])
ATTN_INLINE void transpose8(const float* const* r, float* out, int64_t ld) {
  __m256 t[8], s[8];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = _mm256_loadu_ps(r[2 * i]), b = _mm256_loadu_ps(r[2 * i + 1]);
    t[2 * i] = _mm256_unpacklo_ps(a, b), t[2 * i + 1] = _mm256_unpackhi_ps(a, b);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i .. 4i + 3
    const __m256* u = t + 4 * i;
    __m256* o = s + 4 * i;
    o[0] = _mm256_shuffle_ps(u[0], u[2], 0x44), o[1] = _mm256_shuffle_ps(u[0], u[2], 0xEE);
    o[2] = _mm256_shuffle_ps(u[1], u[3], 0x44), o[3] = _mm256_shuffle_ps(u[1], u[3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ld, _mm256_permute2f128_ps(s[i], s[4 + i], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ld, _mm256_permute2f128_ps(s[i], s[4 + i], 0x31));
  }
}

// keys (or values) j0 .. min(j0 + CH, last + 1) - 1 of one kv head towards L1: the cache is
// L3-resident at best, and the task's next chunk arrives while this one is computed
ATTN_INLINE void prefetch_chunk(const float* first, int64_t stride, int64_t j0, int64_t last,
                                int64_t D) {
  for (int64_t j = j0; j < j0 + ATTN_CH && j <= last; ++j)
    for (int64_t d = 0; d < D; d += 16)
      _mm_prefetch(reinterpret_cast<const char*>(first + j * stride + d), _MM_HINT_T0);
}

// Where key j of the task is stored: itself, but for an alternative's own key
ATTN_INLINE int64_t stored_at(const AttnTask& t, int64_t j) { return j == t.own ? t.at : j; }

// kt[d * CH + j] = key j0 + j of kv head g, d < D; keys past `last` repeat key `last` (their
// scores are never read, and the cache may end before the chunk does)
ATTN_INLINE void transpose_keys(const AttnArgs& a, const AttnTask& t, int64_t j0, int64_t last,
                                float* kt) {
  const int64_t stride = a.kv_heads * a.D;
  const float* k = head_start(a, t, a.k);
  for (int64_t jb = 0; jb < ATTN_CH; jb += 8) {
    const float* rows[8];
    for (int i = 0; i < 8; ++i) {
      const int64_t j = j0 + jb + i;
      rows[i] = k + stored_at(t, j < last ? j : last) * stride;
    }
    for (int64_t d = 0; d < a.D; d += 8) {
      const float* at[8];
      for (int i = 0; i < 8; ++i) at[i] = rows[i] + d;
      transpose8(at, kt + d * ATTN_CH + jb, ATTN_CH);
    }
  }
}

// out[v][0..CH) = scale * (q[v] . the chunk's keys), for N query vectors
template <class V, int N>
ATTN_INLINE void chunk_scores(const float* const* q, const float* kt, int64_t D, float scale,
                              float* const* out) {
  constexpr int B = ATTN_CH / V::W;
  typename V::T acc[N][B];
  for (int n = 0; n < N; ++n)
    for (int b = 0; b < B; ++b) acc[n][b] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename V::T k[B];
    for (int b = 0; b < B; ++b) k[b] = V::load(kt + d * ATTN_CH + b * V::W);
    for (int n = 0; n < N; ++n) {
      const typename V::T qd = V::splat(q[n][d]);
      for (int b = 0; b < B; ++b) acc[n][b] = V::fmadd(qd, k[b], acc[n][b]);
    }
  }
  const typename V::T s = V::splat(scale);
  for (int n = 0; n < N; ++n)
    for (int b = 0; b < B; ++b) V::store(out[n] + b * V::W, V::mul(acc[n][b], s));
}

// chunk_scores for n (1 .. N) vectors
template <class V, int N = V::QK_NV>
inline void scores_n(int n, const float* const* q, const float* kt, int64_t D, float scale,
                     float* const* out) {
  if constexpr (N > 1)
    if (n < N) return scores_n<V, N - 1>(n, q, kt, D, scale, out);
  chunk_scores<V, N>(q, kt, D, scale, out);
}

// out[v][0..D) += sum_j p[v][j] values_j over n keys (values: the first key's row; `stride`
// floats from one key to the next), for N query vectors, 64 dims at a time in registers
template <class V, int N>
ATTN_INLINE void chunk_values(const float* const* p, const float* values, int64_t stride,
                              int64_t n, int64_t D, float* const* out) {
  constexpr int U = 64 / V::W;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    typename V::T acc[N][U];
    for (int v = 0; v < N; ++v)
      for (int u = 0; u < U; ++u) acc[v][u] = V::load(out[v] + d0 + u * V::W);
    const float* row = values + d0;
    for (int64_t j = 0; j < n; ++j, row += stride) {
      typename V::T x[U];
      for (int u = 0; u < U; ++u) x[u] = V::load(row + u * V::W);
      for (int v = 0; v < N; ++v) {
        const typename V::T pj = V::splat(p[v][j]);
        for (int u = 0; u < U; ++u) acc[v][u] = V::fmadd(pj, x[u], acc[v][u]);
      }
    }
    for (int v = 0; v < N; ++v)
      for (int u = 0; u < U; ++u) V::store(out[v] + d0 + u * V::W, acc[v][u]);
  }
}

template <class V, int N = V::AV_NV>
inline void values_n(int n, const float* const* p, const float* values, int64_t stride,
                     int64_t keys, int64_t D, float* const* out) {
  if constexpr (N > 1)
    if (n < N) return values_n<V, N - 1>(n, p, values, stride, keys, D, out);
  chunk_values<V, N>(p, values, stride, keys, D, out);
}

// p[0..n) <- softmax(p), in place (256-bit in every file: the sum's order is the same)
inline void softmax(float* p, int64_t n) {
  // the max 8 lanes at a time (exact in any order): as a scalar loop, one dependent vmaxss per
  // key, it was a large share of the softmax (figures: docs/perf/kernels.md)
  __m256 mv = _mm256_set1_ps(p[0]);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(p + j));
  mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
  mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4E));
  mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xB1));
  for (; j < n; ++j) mv = _mm256_max_ps(mv, _mm256_set1_ps(p[j]));
  __m256 sum = _mm256_setzero_ps();
  j = 0;
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

// The scores of every (row, head) vector of the task that sees each chunk, into p.
template <class V>
void task_scores(const AttnArgs& a, const AttnTask& t, AttnSpan s, float* p, float* kt) {
  for (int64_t j0 = s.base; j0 < s.base + s.width; j0 += ATTN_CH) {
    transpose_keys(a, t, j0, s.hi, kt);
    prefetch_chunk(head_start(a, t, a.k), a.kv_heads * a.D, j0 + ATTN_CH, s.hi, a.D);
    const float* q[V::QK_NV];
    float* out[V::QK_NV];
    int n = 0;
    for (int64_t r = t.r0; r < t.r1; ++r) {
      if (a.lo[r] >= j0 + ATTN_CH || a.hi[r] < j0) continue;  // the row sees no key here
      for (int64_t h = t.h0; h < t.h1; ++h) {
        q[n] = a.q + (r * a.heads + h) * a.D;
        out[n] = scores_of(p, t, s, r, h) + (j0 - s.base);
        if (++n == V::QK_NV) scores_n<V>(n, q, kt, a.D, a.scale, out), n = 0;
      }
    }
    if (n) scores_n<V>(n, q, kt, a.D, a.scale, out);
  }
}

// out of every (row, head) of the task: its softmaxed scores times the values, chunk by chunk
template <class V>
void task_values(const AttnArgs& a, const AttnTask& t, AttnSpan s, float* p) {
  const int64_t stride = a.kv_heads * a.D;
  const float* values = head_start(a, t, a.v);
  for (int64_t j0 = s.base; j0 < s.base + s.width; j0 += ATTN_CH) {
    prefetch_chunk(values, stride, j0 + ATTN_CH, s.hi, a.D);
    for (int64_t r = t.r0; r < t.r1; ++r) {
      const int64_t j1 = a.lo[r] > j0 ? a.lo[r] : j0;
      const int64_t j2 = a.hi[r] < j0 + ATTN_CH - 1 ? a.hi[r] : j0 + ATTN_CH - 1;
      if (j1 > j2) continue;
      // an alternative's own key is its last, stored apart: the chain of fmas goes on
      // through it in the same order, so the row gets the bits it would get in place
      const int64_t split = j1 <= t.own && t.own <= j2 ? t.own : j2 + 1;
      for (int64_t h0 = t.h0; h0 < t.h1; h0 += V::AV_NV) {
        const int n = static_cast<int>(t.h1 - h0 < V::AV_NV ? t.h1 - h0 : V::AV_NV);
        const float* pv[V::AV_NV];
        float* out[V::AV_NV];
        for (int i = 0; i < n; ++i) {
          pv[i] = scores_of(p, t, s, r, h0 + i) + (j1 - s.base);
          out[i] = a.out + (r * a.heads + h0 + i) * a.D;
        }
        if (split > j1) values_n<V>(n, pv, values + j1 * stride, stride, split - j1, a.D, out);
        if (split <= j2) {
          for (int i = 0; i < n; ++i) pv[i] += split - j1;
          values_n<V>(n, pv, values + t.at * stride, stride, 1, a.D, out);
        }
      }
    }
  }
}

// One task whole: p holds rows * heads * span.width floats, kt D x CH.
template <class V>
void attend_task(const AttnArgs& a, const AttnTask& t, float* p, float* kt) {
  const AttnSpan s = attn_span(a, t);
  task_scores<V>(a, t, s, p, kt);
  for (int64_t r = t.r0; r < t.r1; ++r) {
    for (int64_t h = t.h0; h < t.h1; ++h) {
      softmax(scores_of(p, t, s, r, h) + (a.lo[r] - s.base), a.hi[r] - a.lo[r] + 1);
      float* o = a.out + (r * a.heads + h) * a.D;
      for (int64_t d = 0; d < a.D; ++d) o[d] = 0.0f;
    }
  }
  task_values<V>(a, t, s, p);
}

}  // namespace
