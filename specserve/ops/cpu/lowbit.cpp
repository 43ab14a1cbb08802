// Weight-only low-bit linears for AVX2 CPUs: y[M, N] = x[M, K] @ W^T (+ bias), float32 in
// and out, weights kept in blocks of 32 inputs:
//   q8: W = s * q,        q int8,  one float32 scale per block (GGUF Q8_0's own layout)
//   q4: W = s * q + low,  q 0..15, one float32 scale and low per block; a block's 16 bytes
//       hold element i in the low nibble of byte i and element i + 16 in its high nibble.
//   q5: W = s * q + low,  q 0..31: q4's nibbles plus each element's fifth bit (GGUF
//       Q5_0's values come back exactly: low = -16 s).
//
// Why a kernel of our own: one decode step reads every weight once, so its time is weight
// bytes / memory bandwidth. torch's float32 path reads 4 bytes per weight; its int8/int4 CPU
// kernels want bf16 activations, which AVX2 has no instructions for, and are compute-bound
// here. These read 1.125 (q8) or 0.75 (q4) bytes per weight.
//
// Memory layout (made by models/layers/lowbit.py): outputs in tiles of 4 (N padded with
// zero outputs), and for each tile and block one record holding the 4 outputs' block:
//   q8: float s[4]; int8 q[4][32]                  144 bytes
//   q4: float s[4]; float low[4]; uint8 q[4][16]    96 bytes
//   q5: q4's record, then uint8 fifth_bits[16]     112 bytes (layout at struct Q5)
// stored [tile][block][record]. A thread walking its tiles reads one sequential stream,
// which the prefetchers follow at full speed; with one row per output matrix, separate
// scale arrays and 4 outputs read side by side, the same kernel reached half the
// bandwidth (lm_head of the 0.5B, 2 threads: 12.7 ms against 6.4 ms).
//
// As llama.cpp does on CPUs, each row of x is first quantized to int8 in blocks of 32 (one
// scale per block, round to nearest), and a block's dot product runs on integers
// (maddubs + madd: 32 multiply-adds in two instructions). The 4 outputs' integer sums of a
// block are gathered into one vector (a transpose) and scaled into one float32 lane per output.
//
// Batch invariance by construction: y[m, n] is one vector lane that always runs the same
// sequence of operations (row m quantized alone; blocks in order; acc = fma(dot, s * d,
// acc); the same final adds), whatever M is and whichever tile the row lands in. Integer
// block sums are exact, so the order they are summed in does not matter.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 4;
// prefetch this many bytes ahead of the record being read (~8 q8 records)
constexpr int64_t PREFETCH = 1152;

// x quantized per row in blocks of 32: x ~ d * q; `sum` = d * sum(q), for q4's low term.
// Buffers are per calling thread and reused, so a call allocates nothing but y.
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  int64_t nblocks = 0;
};

const QuantRows& quantize_rows(const torch::Tensor& x) {
  thread_local QuantRows r;
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  r.q.resize(M * K), r.d.resize(M * nb), r.sum.resize(M * nb), r.nblocks = nb;
  const float* xp = x.data_ptr<float>();
  int8_t* qp = r.q.data();
  float *dp = r.d.data(), *sp = r.sum.data();
  at::parallel_for(0, M * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const float* v = xp + i * BLOCK;
      float amax = 0.0f;
      for (int j = 0; j < BLOCK; ++j) amax = std::max(amax, std::fabs(v[j]));
      const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int j = 0; j < BLOCK; ++j) {
        const int q = static_cast<int>(std::nearbyint(v[j] * id));
        qp[i * BLOCK + j] = static_cast<int8_t>(q);
        sum += q;
      }
      dp[i] = d;
      sp[i] = d * static_cast<float>(sum);
    }
  });
  return r;
}

// One record's 4 weight blocks in the form the integer dot product takes (maddubs
// multiplies unsigned bytes by signed ones).
struct Q8 {
  static constexpr int64_t RECORD = 16 + TILE * BLOCK;
  static constexpr bool has_low = false;
  __m256i w[TILE], sign[TILE];
  // unsigned operand: |w|; the sign of w moves onto x
  inline void load(const uint8_t* r) {
    for (int c = 0; c < TILE; ++c) {
      sign[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + 16 + c * BLOCK));
      w[c] = _mm256_sign_epi8(sign[c], sign[c]);
    }
  }
  inline __m256i dot(int c, __m256i x) const {
    const __m256i p = _mm256_maddubs_epi16(w[c], _mm256_sign_epi8(x, sign[c]));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
  }
  static inline __m128 lows(const uint8_t*) { return _mm_setzero_ps(); }
};

struct Q4 {
  static constexpr int64_t RECORD = 32 + TILE * BLOCK / 2;
  static constexpr bool has_low = true;
  __m256i w[TILE];
  inline void load(const uint8_t* r) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    for (int c = 0; c < TILE; ++c) {
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + 32 + c * 16));
      const __m128i l = _mm_and_si128(p, mask), h = _mm_and_si128(_mm_srli_epi16(p, 4), mask);
      w[c] = _mm256_set_m128i(h, l);  // elements 0..15, then 16..31
    }
  }
  inline __m256i dot(int c, __m256i x) const {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w[c], x), _mm256_set1_epi16(1));
  }
  static inline __m128 lows(const uint8_t* r) {
    return _mm_loadu_ps(reinterpret_cast<const float*>(r + 16));
  }
};

// q4's nibbles plus the fifth bits of the 4 outputs in 16 bytes: bit c of byte j is output
// c's element j, bit c + 4 its element j + 16. Broadcast to both halves of a vector, one
// AND + compare per output picks its bits (a 32-bit word per output took twice the work).
struct Q5 : Q4 {
  static constexpr int64_t RECORD = Q4::RECORD + 16;
  inline void load(const uint8_t* r) {
    Q4::load(r);
    const __m256i planes = _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + Q4::RECORD)));
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int c = 0; c < TILE; ++c) {
      const __m256i bit = _mm256_setr_m128i(_mm_set1_epi8(static_cast<char>(1 << c)),
                                            _mm_set1_epi8(static_cast<char>(1 << (c + 4))));
      const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(planes, bit), bit);
      w[c] = _mm256_or_si256(w[c], _mm256_and_si256(set, sixteen));
    }
  }
};

// The 4 outputs' integer dot products with one x block: [dot_0, dot_1, dot_2, dot_3]. A
// transpose by unpacks and adds (one uop each) instead of hadd (three uops on Zen 3), which
// bounded the verification rows.
template <class W>
inline __m128i dots(const W& w, __m256i x) {
  const __m256i d0 = w.dot(0, x), d1 = w.dot(1, x), d2 = w.dot(2, x), d3 = w.dot(3, x);
  // per 128-bit half: [d0 d1 d0 d1] partials, then [d2 d3 d2 d3]
  const __m256i s01 = _mm256_add_epi32(_mm256_unpacklo_epi32(d0, d1), _mm256_unpackhi_epi32(d0, d1));
  const __m256i s23 = _mm256_add_epi32(_mm256_unpacklo_epi32(d2, d3), _mm256_unpackhi_epi32(d2, d3));
  // per half: [d0 d1 d2 d3] partials
  const __m256i h = _mm256_add_epi32(_mm256_unpacklo_epi64(s01, s23), _mm256_unpackhi_epi64(s01, s23));
  return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

// y[m0 .. m0+R, n0 .. n0+4) from one tile's records; row r's 4 outputs are one __m128.
template <int R, class W>
inline void tile(const uint8_t* records, const QuantRows& x, int64_t m0, int64_t n0,
                 int64_t n_out, float* y, const float* bias) {
  const int64_t nb = x.nblocks;
  __m128 acc[R], low[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm_setzero_ps(), low[r] = _mm_setzero_ps();
  W w;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = records + b * W::RECORD;
    for (int64_t off = 0; off < W::RECORD; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH + off), _MM_HINT_T0);
    w.load(rec);
    const __m128 scale = _mm_loadu_ps(reinterpret_cast<const float*>(rec));
    const __m128 lows = W::lows(rec);
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&x.q[i * BLOCK]));
      const __m128 dot = _mm_cvtepi32_ps(dots(w, xq));  // exact: |dot| < 2^24
      acc[r] = _mm_fmadd_ps(dot, _mm_mul_ps(scale, _mm_set1_ps(x.d[i])), acc[r]);
      if constexpr (W::has_low) low[r] = _mm_fmadd_ps(lows, _mm_set1_ps(x.sum[i]), low[r]);
    }
  }
  const int64_t valid = std::min<int64_t>(TILE, n_out - n0);
  for (int r = 0; r < R; ++r) {
    alignas(16) float out[TILE];
    _mm_store_ps(out, _mm_add_ps(acc[r], low[r]));
    float* row = y + (m0 + r) * n_out + n0;
    for (int c = 0; c < valid; ++c) row[c] = out[c] + (bias ? bias[n0 + c] : 0.0f);
  }
}

// Rows m_begin..m_end of one tile, R rows at a time, the last group smaller (R-1 .. 1).
template <int R, class W>
inline void rows(const uint8_t* records, const QuantRows& x, int64_t m_begin, int64_t m_end,
                 int64_t n0, int64_t n_out, float* y, const float* bias) {
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) tile<R, W>(records, x, m, n0, n_out, y, bias);
  if constexpr (R > 1) {
    if (m < m_end) rows<R - 1, W>(records, x, m, m_end, n0, n_out, y, bias);
  }
}

// rows sharing each weight record read (verification rows, prefill)
constexpr int ROWS = 4;
// x rows in chunks of about this many bytes, so that a chunk stays in L2 while a thread
// walks its tiles (a tile's records are read once per chunk)
constexpr int64_t CHUNK_BYTES = 256 * 1024;

// y = x @ W^T + bias for a whole call: quantize x's rows, then walk the tiles.
template <class W>
torch::Tensor run(const torch::Tensor& x_in, const torch::Tensor& records, int64_t n_out,
                  const c10::optional<torch::Tensor>& b) {
  const int64_t M = x_in.size(0), K = x_in.size(1);
  auto y = torch::empty({M, n_out}, x_in.options());
  if (M == 0) return y;
  const QuantRows& x = quantize_rows(x_in);
  const float* bias = b ? b->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const uint8_t* base = records.data_ptr<uint8_t>();
  const int64_t tiles = records.size(0), tile_bytes = x.nblocks * W::RECORD;
  const int64_t chunk = std::max<int64_t>(ROWS, CHUNK_BYTES / K / ROWS * ROWS);
  // about 64K weights per task: small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (K * TILE));
  // tiles split across threads, so each weight is read from memory once per row chunk
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t mc = 0; mc < M; mc += chunk) {
      const int64_t me = std::min(M, mc + chunk);
      for (int64_t t = t0; t < t1; ++t)
        rows<ROWS, W>(base + t * tile_bytes, x, mc, me, t * TILE, n_out, yp, bias);
    }
  });
  return y;
}

template <class W>
torch::Tensor linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                     const c10::optional<torch::Tensor>& bias) {
  x = x.contiguous();
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "lowbit linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "lowbit linear: in_features must be a multiple of 32");
  TORCH_CHECK(records.scalar_type() == torch::kUInt8 && records.is_contiguous() &&
                  records.dim() == 3 && records.size(0) * TILE >= n_out &&
                  records.size(0) * TILE < n_out + TILE &&
                  records.size(1) * BLOCK == x.size(1) && records.size(2) == W::RECORD,
              "lowbit linear: records must be uint8 [ceil(N/4), K/32, ", W::RECORD, "]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == n_out,
                "lowbit linear: bias must be float32 [N]");
  }
  return run<W>(x, records, n_out, bias);
}

}  // namespace

torch::Tensor q8_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias) {
  return linear<Q8>(std::move(x), records, n_out, bias);
}

torch::Tensor q4_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias) {
  return linear<Q4>(std::move(x), records, n_out, bias);
}

torch::Tensor q5_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias) {
  return linear<Q5>(std::move(x), records, n_out, bias);
}
