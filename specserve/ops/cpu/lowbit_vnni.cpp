// The low-bit kernels' block dots with AVX-512 VNNI (256-bit vectors, AVX512VL), for CPUs
// that have it (Zen 4 and later, Intel since Ice Lake); lowbit.cpp picks this file's
// `vnni_tile_rows` at run time and keeps its AVX2 dots for the rest.
//
// Why: vpdpbusd multiplies 4 unsigned by 4 signed bytes per 32-bit lane and adds them into
// the lane, with no 16-bit intermediate to saturate. One instruction replaces AVX2's
// maddubs + madd + add (and q8's sign), so each extra row of x (verification, prefill,
// other slots) costs one multiply per step instead of two to four, and with 32 vector
// registers a tile takes 8 rows per record read instead of 4.
//   q4/q5: weights are the unsigned operand (0..15 / 0..31), x the signed one.
//   q8: x + 128 is the unsigned operand (XRows::u) and the int8 weights the signed one;
//       sum((q_x + 128) w) - 128 sum(w) is the exact dot, sum(w) from one more vpdpbusd
//       per step with ones, shared by every row of the tile.
// The dots are exact integers, as on AVX2, and lowbit_tile.h turns them into float32 with
// the same operations: both paths give the same bits.
//
// Everything below is compiled for AVX-512; the file uses no standard-library templates
// (see lowbit_tile.h) and no torch headers.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

#include "lowbit_tile.h"

namespace {

constexpr int ROWS = 8;  // 32 registers: 8 accumulators and 8 dots stay in registers

// A block's dots are a chain of 8 vpdpbusd per row (latency ~4 cycles each). With one row
// (decode) that chain, not memory, set the pace: q5 took ~33 cycles a block, where reading
// its 176 bytes at one core's bandwidth takes ~20. So even and odd steps run in two chains,
// at every row count: with 5-7 rows in one chain each the dots were still latency-bound,
// and a fifth row cost 1.9x what the fourth did (L2-resident q5, one thread); with two
// chains every row up to 8 costs about the same (32 registers hold 8 rows' three vectors).

// the two chains of each row added (exact integers, so the split changes no bits)
template <int R>
LOWBIT_INLINE void join(__m256i* d, const __m256i* e) {
  for (int r = 0; r < R; ++r) d[r] = _mm256_add_epi32(d[r], e[r]);
}

struct Q8 : lowbit::Q8Layout {
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i wsum[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()}, e[R];
    for (int r = 0; r < R; ++r) d[r] = e[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {  // even and odd steps in two chains (see above)
      const __m256i w0 = load(rec + WEIGHTS + 32 * j), w1 = load(rec + WEIGHTS + 32 * j + 32);
      wsum[0] = _mm256_dpbusd_epi32(wsum[0], ones, w0);
      wsum[1] = _mm256_dpbusd_epi32(wsum[1], ones, w1);
      for (int r = 0; r < R; ++r) {
        const uint8_t* xr = x.u + idx[r] * BLOCK;
        d[r] = _mm256_dpbusd_epi32(d[r], broadcast4(xr, j), w0);
        e[r] = _mm256_dpbusd_epi32(e[r], broadcast4(xr, j + 1), w1);
      }
    }
    join<R>(d, e);
    const __m256i shift = _mm256_slli_epi32(_mm256_add_epi32(wsum[0], wsum[1]), 7);
    for (int r = 0; r < R; ++r) d[r] = _mm256_sub_epi32(d[r], shift);
  }
};

// steps 2i and 2i+1 (bytes lo, hi) into R rows' dots: the odd steps into e
template <int R>
LOWBIT_INLINE void add_pair(__m256i lo, __m256i hi, const XRows& x, const int64_t* idx, int i,
                            __m256i* d, __m256i* e) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.q + idx[r] * BLOCK;
    d[r] = _mm256_dpbusd_epi32(d[r], lo, broadcast4(xr, 2 * i));
    e[r] = _mm256_dpbusd_epi32(e[r], hi, broadcast4(xr, 2 * i + 1));
  }
}


struct Q4 : lowbit::Q4Layout {
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    __m256i e[R];
    for (int r = 0; r < R; ++r) d[r] = e[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      __m256i lo, hi;
      nibble_pair(rec + WEIGHTS, i, lo, hi);
      add_pair<R>(lo, hi, x, idx, i, d, e);
    }
    join<R>(d, e);
  }
};

struct Q5 : lowbit::Q5Layout {
  template <int I, int R>
  static LOWBIT_INLINE void pair(const uint8_t* rec, __m256i plane, const XRows& x,
                                 const int64_t* idx, __m256i* d, __m256i* e) {
    __m256i lo, hi;
    q5_pair<I>(rec, plane, lo, hi);
    add_pair<R>(lo, hi, x, idx, I, d, e);
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    const __m256i plane = load(rec + PLANE);
    __m256i e[R];
    for (int r = 0; r < R; ++r) d[r] = e[r] = _mm256_setzero_si256();
    pair<0, R>(rec, plane, x, idx, d, e);
    pair<1, R>(rec, plane, x, idx, d, e);
    pair<2, R>(rec, plane, x, idx, d, e);
    pair<3, R>(rec, plane, x, idx, d, e);
    join<R>(d, e);
    q5_offset<R>(x, idx, d);
  }
};

}  // namespace

void lowbit::vnni_tile_rows(int64_t kind, const uint8_t* records, const XRows& x, int64_t m0,
                            int64_t m1, int64_t n0, int64_t n_out, float* y, const float* bias) {
  kind_rows<ROWS, Q8, Q4, Q5>(kind, records, x, m0, m1, n0, n_out, y, bias);  // Q6: the shared AVX2 dots
}
