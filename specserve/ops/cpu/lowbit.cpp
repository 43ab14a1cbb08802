// Weight-only low-bit linears for AVX2 CPUs: y[M, N] = x[M, K] @ W^T (+ bias), float32 in
// and out, weights kept in blocks of 32 inputs:
//   q8: W = s * q,        q int8,  one float32 scale per block (GGUF Q8_0's own layout)
//   q4: W = s * q + low,  q 0..15, one float32 scale and low per block
//   q5: W = s * q + low,  q 0..31 (GGUF Q5_0's values come back exactly: low = -16 s)
//
// Why a kernel of our own: one decode step reads every weight once, so its time is weight
// bytes / memory bandwidth. torch's float32 path reads 4 bytes per weight; its int8/int4 CPU
// kernels want bf16 activations, which AVX2 has no instructions for, and are compute-bound
// here. These read 1.125 (q8), 0.875 (q5) or 0.75 (q4) bytes per weight.
//
// As llama.cpp does on CPUs, each row of x is first quantized to int8 in blocks of 32 (one
// scale per block, round to nearest), and a block's dot products run on integers: maddubs
// multiplies 32 unsigned by 32 signed bytes and adds pairs, madd adds pairs again.
//
// Memory layout (made by models/layers/lowbit.py): outputs in tiles of 8, one record per
// tile and block, stored [tile][block][record] so that a thread walking its tiles reads one
// sequential stream (at full bandwidth with a prefetch ahead):
//   q8: float s[8]; int8 w[8 steps][8 outputs][4]                        288 bytes
//   q4: float s[8]; float low[8]; uint8 w[4][8][4]: step 2i in the low nibbles of
//       array i, step 2i+1 in its high nibbles                            192 bytes
//   q5: q4's record, then uint8 fifth[32]: bit j of byte i is step j's byte i   224 bytes
// A step is 4 consecutive inputs of each of the 8 outputs: one 256-bit vector whose 32-bit
// lane o is output o. Multiplied by x's 4 bytes broadcast to every lane, maddubs + madd
// leave output o's 4-input dot in lane o, so the 8 outputs' block dots add up vertically in
// one vector and meet their scales as one float32 lane each; no horizontal sums. The weight
// vector is loaded (and for q4/q5 unpacked) once per step and serves every row of x in the
// tile, so each extra row (verification, prefill, other slots) costs about three
// instructions per step: broadcast, multiply, add. (The previous layout, 4 outputs per
// record with a 32-input block per output, spent a transpose per row and block.)
// q4/q5 products fit in 16 bits for several steps (|q x| <= 31 * 127 per product), so they
// are summed in 16 bits and widened once or twice per block.
//
// Batch invariance by construction: y[m, n] is one vector lane that always runs the same
// sequence of operations (row m quantized alone; blocks in order; exact integer block dots;
// acc = fma(dot, s * d, acc), then acc = fma(low, d * sum(q_x), acc); the same final add),
// whatever M is and whichever group of rows the row lands in.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels.h"

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 8;
constexpr int64_t SCALES = TILE * 4;  // bytes of one float32 field of a record
// prefetch this many bytes ahead of the record being read (4 q8 records)
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

inline __m256i load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// x's 4 bytes of step j, in every 32-bit lane
inline __m256i broadcast4(const int8_t* x, int j) {
  int32_t v;
  std::memcpy(&v, x + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// Exact int32 block dots of the record's 8 outputs (one lane each) with R rows' x blocks.
// maddubs takes an unsigned operand: q8 moves w's sign onto x (sign_epi8), q4/q5 weights
// are unsigned already (their low term carries the offset).
struct Q8 {
  static constexpr int64_t RECORD = SCALES + TILE * BLOCK;
  static constexpr bool has_low = false;
  template <int R>
  static inline void dots(const uint8_t* rec, const int8_t* const* x, __m256i* d) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load(rec + SCALES + 32 * j), wabs = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(broadcast4(x[r], j), w));
        d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(p, ones));  // |p| <= 2 * 127^2
      }
    }
  }
};

// Steps 2i and 2i+1 of a q4 record (its i-th nibble array), as bytes 0..15.
inline void nibble_pair(const uint8_t* rec, int i, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F), p = load(rec + 2 * SCALES + 32 * i);
  lo = _mm256_and_si256(p, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
}

// 16-bit sums of steps 2i and 2i+1 for R rows (each product <= 31 * 127)
template <int R>
inline void add_pair(__m256i lo, __m256i hi, const int8_t* const* x, int i, __m256i* s) {
  for (int r = 0; r < R; ++r) {
    const __m256i a = _mm256_maddubs_epi16(lo, broadcast4(x[r], 2 * i));
    const __m256i b = _mm256_maddubs_epi16(hi, broadcast4(x[r], 2 * i + 1));
    s[r] = _mm256_add_epi16(s[r], _mm256_add_epi16(a, b));
  }
}

struct Q4 {
  static constexpr int64_t RECORD = 2 * SCALES + TILE * BLOCK / 2;
  static constexpr bool has_low = true;
  template <int R>
  static inline void dots(const uint8_t* rec, const int8_t* const* x, __m256i* d) {
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {  // 8 steps of 2 products <= 15 * 127: fits 16 bits
      __m256i lo, hi;
      nibble_pair(rec, i, lo, hi);
      add_pair<R>(lo, hi, x, i, s);
    }
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) d[r] = _mm256_madd_epi16(s[r], ones);
  }
};

// Bit J of each byte of the fifth-bit plane, moved to bit 4 (the value 16).
template <int J>
inline __m256i fifth(__m256i plane) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  // 16-bit shifts: bit J of either byte of a lane lands on bit 4 of the same byte
  if constexpr (J < 4) return _mm256_and_si256(_mm256_slli_epi16(plane, 4 - J), sixteen);
  else if constexpr (J == 4) return _mm256_and_si256(plane, sixteen);
  else return _mm256_and_si256(_mm256_srli_epi16(plane, J - 4), sixteen);
}

struct Q5 {
  static constexpr int64_t RECORD = Q4::RECORD + 32;
  static constexpr bool has_low = true;
  template <int I, int R>
  static inline void pair(const uint8_t* rec, __m256i plane, const int8_t* const* x, __m256i* s) {
    __m256i lo, hi;
    nibble_pair(rec, I, lo, hi);
    lo = _mm256_or_si256(lo, fifth<2 * I>(plane));
    hi = _mm256_or_si256(hi, fifth<2 * I + 1>(plane));
    add_pair<R>(lo, hi, x, I, s);
  }
  template <int R>
  static inline void dots(const uint8_t* rec, const int8_t* const* x, __m256i* d) {
    const __m256i plane = load(rec + Q4::RECORD), ones = _mm256_set1_epi16(1);
    __m256i s[R], t[R];
    for (int r = 0; r < R; ++r) s[r] = t[r] = _mm256_setzero_si256();
    // 4 steps of 2 products <= 31 * 127 fit 16 bits: two halves, widened separately
    pair<0, R>(rec, plane, x, s);
    pair<1, R>(rec, plane, x, s);
    pair<2, R>(rec, plane, x, t);
    pair<3, R>(rec, plane, x, t);
    for (int r = 0; r < R; ++r)
      d[r] = _mm256_add_epi32(_mm256_madd_epi16(s[r], ones), _mm256_madd_epi16(t[r], ones));
  }
};

// y[m0 .. m0+R, n0 .. n0+8) from one tile's records; row r's 8 outputs are one __m256.
template <int R, class W>
inline void tile(const uint8_t* records, const QuantRows& x, int64_t m0, int64_t n0,
                 int64_t n_out, float* y, const float* bias) {
  const int64_t nb = x.nblocks;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = records + b * W::RECORD;
    for (int64_t off = 0; off < W::RECORD; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + PREFETCH + off), _MM_HINT_T0);
    const int8_t* xb[R];
    for (int r = 0; r < R; ++r) xb[r] = &x.q[((m0 + r) * nb + b) * BLOCK];
    __m256i dot[R];
    W::template dots<R>(rec, xb, dot);
    const __m256 scale = _mm256_loadu_ps(reinterpret_cast<const float*>(rec));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * nb + b;
      const __m256 d = _mm256_cvtepi32_ps(dot[r]);  // exact: |dot| < 2^24
      acc[r] = _mm256_fmadd_ps(d, _mm256_mul_ps(scale, _mm256_set1_ps(x.d[i])), acc[r]);
      if constexpr (W::has_low) {
        const __m256 low = _mm256_loadu_ps(reinterpret_cast<const float*>(rec + SCALES));
        acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(x.sum[i]), acc[r]);
      }
    }
  }
  const int64_t valid = std::min<int64_t>(TILE, n_out - n0);
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[TILE];
    _mm256_store_ps(out, acc[r]);
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
                  const c10::optional<torch::Tensor>& b, const c10::optional<torch::Tensor>& out) {
  const int64_t M = x_in.size(0), K = x_in.size(1);
  auto y = out ? *out : torch::empty({M, n_out}, x_in.options());
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
                     const c10::optional<torch::Tensor>& bias,
                     const c10::optional<torch::Tensor>& out) {
  x = x.contiguous();
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "lowbit linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "lowbit linear: in_features must be a multiple of 32");
  TORCH_CHECK(records.scalar_type() == torch::kUInt8 && records.is_contiguous() &&
                  records.dim() == 3 && records.size(0) * TILE >= n_out &&
                  records.size(0) * TILE < n_out + TILE &&
                  records.size(1) * BLOCK == x.size(1) && records.size(2) == W::RECORD,
              "lowbit linear: records must be uint8 [ceil(N/8), K/32, ", W::RECORD, "]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == n_out,
                "lowbit linear: bias must be float32 [N]");
  }
  if (out) {  // a caller's buffer (the engine's logits): no allocation, no page faults
    TORCH_CHECK(out->device().is_cpu() && out->scalar_type() == torch::kFloat32 &&
                    out->is_contiguous() && out->dim() == 2 && out->size(0) == x.size(0) &&
                    out->size(1) == n_out,
                "lowbit linear: out must be a contiguous float32 CPU tensor [M, N]");
  }
  return run<W>(x, records, n_out, bias, out);
}

}  // namespace

torch::Tensor q8_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& out) {
  return linear<Q8>(std::move(x), records, n_out, bias, out);
}

torch::Tensor q4_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& out) {
  return linear<Q4>(std::move(x), records, n_out, bias, out);
}

torch::Tensor q5_linear(torch::Tensor x, const torch::Tensor& records, int64_t n_out,
                        const c10::optional<torch::Tensor>& bias,
                        const c10::optional<torch::Tensor>& out) {
  return linear<Q5>(std::move(x), records, n_out, bias, out);
}
