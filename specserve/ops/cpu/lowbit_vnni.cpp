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

struct Q8 : lowbit::Q8Layout {
  template <int R>
  static inline void dots(const uint8_t* rec, const XRows& x, const int64_t* idx, __m256i* d) {
    const __m256i ones = _mm256_set1_epi8(1);
    __m256i wsum = _mm256_setzero_si256();
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const __m256i w = load(rec + WEIGHTS + 32 * j);
      wsum = _mm256_dpbusd_epi32(wsum, ones, w);
      for (int r = 0; r < R; ++r)
        d[r] = _mm256_dpbusd_epi32(d[r], broadcast4(x.u + idx[r] * BLOCK, j), w);
    }
    const __m256i shift = _mm256_slli_epi32(wsum, 7);
    for (int r = 0; r < R; ++r) d[r] = _mm256_sub_epi32(d[r], shift);
  }
};

// steps 2i and 2i+1 (bytes lo, hi) into R rows' dots
template <int R>
inline void add_pair(__m256i lo, __m256i hi, const XRows& x, const int64_t* idx, int i,
                     __m256i* d) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.q + idx[r] * BLOCK;
    d[r] = _mm256_dpbusd_epi32(d[r], lo, broadcast4(xr, 2 * i));
    d[r] = _mm256_dpbusd_epi32(d[r], hi, broadcast4(xr, 2 * i + 1));
  }
}

struct Q4 : lowbit::Q4Layout {
  template <int R>
  static inline void dots(const uint8_t* rec, const XRows& x, const int64_t* idx, __m256i* d) {
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    for (int i = 0; i < 4; ++i) {
      __m256i lo, hi;
      nibble_pair(rec + WEIGHTS, i, lo, hi);
      add_pair<R>(lo, hi, x, idx, i, d);
    }
  }
};

struct Q5 : lowbit::Q5Layout {
  template <int I, int R>
  static inline void pair(const uint8_t* rec, __m256i plane, const XRows& x, const int64_t* idx,
                          __m256i* d) {
    __m256i lo, hi;
    q5_pair<I>(rec, plane, lo, hi);
    add_pair<R>(lo, hi, x, idx, I, d);
  }
  template <int R>
  static inline void dots(const uint8_t* rec, const XRows& x, const int64_t* idx, __m256i* d) {
    const __m256i plane = load(rec + PLANE);
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    pair<0, R>(rec, plane, x, idx, d);
    pair<1, R>(rec, plane, x, idx, d);
    pair<2, R>(rec, plane, x, idx, d);
    pair<3, R>(rec, plane, x, idx, d);
    q5_offset<R>(x, idx, d);
  }
};

}  // namespace

void lowbit::vnni_tile_rows(int64_t kind, const uint8_t* records, const XRows& x, int64_t m0,
                            int64_t m1, int64_t n0, int64_t n_out, float* y, const float* bias) {
  kind_rows<ROWS, Q8, Q4, Q5>(kind, records, x, m0, m1, n0, n_out, y, bias);
}
