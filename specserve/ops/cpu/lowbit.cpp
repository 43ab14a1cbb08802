// Weight-only low-bit linears for AVX2 CPUs: y[M, N] = x[M, K] @ W^T (+ bias), float32 in
// and out, weights kept in blocks of 32 inputs:
//   q8: W = s * q,        q int8,  one float32 scale per block (GGUF Q8_0's own layout)
//   q4: W = s * q + low,  q 0..15, one float32 scale and low per block; a block's 16 bytes
//       hold element i in the low nibble of byte i and element i + 16 in its high nibble.
//
// Why a kernel of our own: one decode step reads every weight once, so its time is weight
// bytes / memory bandwidth. torch's float32 path reads 4 bytes per weight; its int8/int4 CPU
// kernels want bf16 activations, which AVX2 has no instructions for, and are compute-bound
// here. These read 1.125 (q8) or 0.75 (q4) bytes per weight.
//
// As llama.cpp does on CPUs, each row of x is first quantized to int8 in blocks of 32 (one
// scale per block, round to nearest), and a block's dot product runs on integers
// (maddubs + madd: 32 multiply-adds in two instructions), then is scaled into a float32
// accumulator. Dequantizing the weights to float32 instead made one decode step
// compute-bound on this project's AVX2 machine (~15 G weights/s for 2 cores, against ~28
// GB/s of memory bandwidth).
//
// Batch invariance by construction: y[m, n] is always computed by the same sequence of
// operations (row m quantized alone; one 8-lane accumulator, blocks in order, the same final
// reduction), whatever M is and whichever tile the row lands in. Tiles only decide how many
// (m, n) pairs are in flight together, so that a weight block read from memory serves
// several rows and the FMA latency is hidden.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>

namespace {

constexpr int64_t BLOCK = 32;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// x quantized per row in blocks of 32: x ~ d * q; `sum` = d * sum(q), for q4's low term.
struct QuantRows {
  torch::Tensor q, d, sum;
  const int8_t* qp;
  const float *dp, *sp;
  int64_t K, nblocks;
};

QuantRows quantize_rows(const torch::Tensor& x) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / BLOCK;
  QuantRows r{torch::empty({M, K}, torch::kInt8), torch::empty({M, nb}, torch::kFloat32),
              torch::empty({M, nb}, torch::kFloat32)};
  const float* xp = x.data_ptr<float>();
  int8_t* qp = r.q.data_ptr<int8_t>();
  float* dp = r.d.data_ptr<float>();
  float* sp = r.sum.data_ptr<float>();
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
  r.qp = qp, r.dp = dp, r.sp = sp, r.K = K, r.nblocks = nb;
  return r;
}

// The weights of one block as 32 bytes the integer dot product takes (maddubs multiplies
// unsigned bytes by signed ones), plus the x row's bytes adjusted to match.
struct Q8 {
  const int8_t* q;
  const float* s;
  int64_t ldq, lds;
  static constexpr bool has_low = false;
  // unsigned operand: |w|; the sign of w moves onto x
  inline __m256i load(int64_t n, int64_t b, __m256i& sign) const {
    sign = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + n * ldq + b * BLOCK));
    return _mm256_sign_epi8(sign, sign);
  }
  static inline __m256i signed_x(__m256i x, __m256i sign) { return _mm256_sign_epi8(x, sign); }
  inline float scale(int64_t n, int64_t b) const { return s[n * lds + b]; }
  inline float low(int64_t, int64_t) const { return 0.0f; }
};

struct Q4 {
  const uint8_t* q;
  const float* s;
  const float* lo;
  int64_t ldq, lds;
  static constexpr bool has_low = true;
  inline __m256i load(int64_t n, int64_t b, __m256i&) const {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + n * ldq + b * 16));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i l = _mm_and_si128(packed, mask);
    const __m128i h = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
    return _mm256_set_m128i(h, l);  // elements 0..15, then 16..31
  }
  static inline __m256i signed_x(__m256i x, __m256i) { return x; }
  inline float scale(int64_t n, int64_t b) const { return s[n * lds + b]; }
  inline float low(int64_t n, int64_t b) const { return lo[n * lds + b]; }
};

// y[m0 .. m0+R, n0 .. n0+C] for one tile; every (m, n) runs the same operation sequence.
template <int C, int R, class W>
inline void tile(const W& wt, const QuantRows& x, int64_t m0, int64_t n0, float* y, int64_t ldy,
                 const float* bias) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[C][R];
  float lows[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = _mm256_setzero_ps(), lows[c][r] = 0.0f;
  for (int64_t b = 0; b < x.nblocks; ++b) {
    for (int c = 0; c < C; ++c) {
      __m256i sign;
      const __m256i w = wt.load(n0 + c, b, sign);
      const float ws = wt.scale(n0 + c, b);
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * x.nblocks + b;
        const __m256i xr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.qp + i * BLOCK));
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(w, W::signed_x(xr, sign)), ones);
        acc[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ws * x.dp[i]), acc[c][r]);
        if constexpr (W::has_low) lows[c][r] += wt.low(n0 + c, b) * x.sp[i];
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r)
      y[(m0 + r) * ldy + n0 + c] = hsum(acc[c][r]) + lows[c][r] + (bias ? bias[n0 + c] : 0.0f);
}

// Rows m_begin..m_end in tiles of R, the last tile smaller (R-1 .. 1).
template <int C, int R, class W>
inline void rows(const W& wt, const QuantRows& x, int64_t m_begin, int64_t m_end, int64_t n0,
                 float* y, int64_t ldy, const float* bias) {
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) tile<C, R>(wt, x, m, n0, y, ldy, bias);
  if constexpr (R > 1) {
    if (m < m_end) rows<C, R - 1>(wt, x, m, m_end, n0, y, ldy, bias);
  }
}

// A tile is COLS outputs x ROWS rows, one accumulator each, all in registers. One row
// (decode) takes 4 outputs at a time, so four FMA chains hide the FMA latency; more rows
// (verification) share each weight block among up to 4 rows.
constexpr int COLS = 4;
constexpr int COLS_BATCH = 2;
constexpr int ROWS = 4;
// rows in chunks that stay in cache while a thread walks its outputs
constexpr int64_t ROW_CHUNK = 32;

// y = x @ W^T + bias for a whole call: quantize x's rows, then walk W's outputs.
template <class W>
torch::Tensor run(const W& wt, const torch::Tensor& x_in, int64_t n_out,
                  const c10::optional<torch::Tensor>& b) {
  const int64_t M = x_in.size(0);
  auto y = torch::empty({M, n_out}, x_in.options());
  const QuantRows x = quantize_rows(x_in);
  const float* bias = b ? b->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (n_out + COLS - 1) / COLS;
  // about 64K weights per task: small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (x.K * COLS));
  // outputs split across threads, so each weight is read from memory once per call
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t mc = 0; mc < M; mc += ROW_CHUNK) {
      const int64_t me = std::min(M, mc + ROW_CHUNK);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t n0 = t * COLS;
        if (n0 + COLS > n_out) {
          for (int64_t n = n0; n < n_out; ++n) rows<1, ROWS>(wt, x, mc, me, n, yp, n_out, bias);
        } else if (me - mc == 1) {
          tile<COLS, 1>(wt, x, mc, n0, yp, n_out, bias);
        } else {
          for (int c = 0; c < COLS; c += COLS_BATCH)
            rows<COLS_BATCH, ROWS>(wt, x, mc, me, n0 + c, yp, n_out, bias);
        }
      }
    }
  });
  return y;
}

void check_input(const torch::Tensor& x, const torch::Tensor& s,
                 const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "lowbit linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "lowbit linear: in_features must be a multiple of 32");
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.is_contiguous() && s.dim() == 2 &&
                  s.size(1) == x.size(1) / BLOCK,
              "lowbit linear: scales must be float32 [N, K/32]");
  if (bias) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                    bias->numel() == s.size(0),
                "lowbit linear: bias must be float32 [N]");
  }
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s,
                        c10::optional<torch::Tensor> bias) {
  x = x.contiguous();
  check_input(x, s, bias);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.dim() == 2 &&
                  q.size(1) == x.size(1) && q.size(0) == s.size(0),
              "q8_linear: q must be int8 [N, K]");
  const Q8 wt{q.data_ptr<int8_t>(), s.data_ptr<float>(), q.size(1), s.size(1)};
  return run(wt, x, q.size(0), bias);
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, torch::Tensor low,
                        c10::optional<torch::Tensor> bias) {
  x = x.contiguous();
  check_input(x, s, bias);
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous() && q.dim() == 2 &&
                  q.size(1) * 2 == x.size(1) && q.size(0) == s.size(0),
              "q4_linear: q must be uint8 [N, K/2]");
  TORCH_CHECK(low.sizes() == s.sizes() && low.scalar_type() == torch::kFloat32 &&
                  low.is_contiguous(),
              "q4_linear: low must be float32 like the scales");
  const Q4 wt{q.data_ptr<uint8_t>(), s.data_ptr<float>(), low.data_ptr<float>(), q.size(1),
              s.size(1)};
  return run(wt, x, q.size(0), bias);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x @ (s*q)^T + bias, int8 blocks of 32");
  m.def("q4_linear", &q4_linear, "x @ (s*q+low)^T + bias, 4-bit blocks of 32");
}
