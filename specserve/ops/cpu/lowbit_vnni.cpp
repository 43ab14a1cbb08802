// The low-bit kernels' block dots with AVX-512 VNNI on 512-bit vectors, for CPUs that have
// it (Zen 4 and later, Intel since Ice Lake); lowbit.cpp picks this file's `vnni_tile_rows`
// at run time and keeps its AVX2 dots for the rest.
//
// Why: vpdpbusd multiplies 4 unsigned by 4 signed bytes per 32-bit lane and adds them into
// the lane, with no 16-bit intermediate to saturate. One instruction replaces AVX2's
// maddubs + madd + add (and q8's sign), so each extra row of x (verification, prefill,
// other slots) costs one multiply per step instead of two to four, and with 32 vector
// registers a group takes 8 rows per record read instead of 4.
//   q4/q5/q6/q4k: weights are the unsigned operand (0..15 / 0..31 / 0..63), x the signed one.
//   q8: the records hold w + 128 (lowbit.py), the unsigned operand, and x the signed one:
//       sum((w + 128) q_x) - 128 sum(q_x) is the exact dot, the chain starting at the
//       second term. (With x + 128 unsigned, sum(w) took one more vpdpbusd a step;
//       figures: docs/perf/lowbit.md.)
// From lowbit.cpp's `pair_rows` rows up (4, or as a model's loading timed it) each vector
// (Z) holds two neighbouring tiles (16 outputs: the first tile's record in the low 256 bits,
// the second's, `stride` bytes on, in the high), so every instruction does twice the work of
// a 256-bit one: Zen 5 runs 512-bit vpdpbusd at the rate of 256-bit ones (two a cycle), and
// that rate bounds verification's and prefill's many rows. Fewer rows run one tile per
// 256-bit vector (YV): on a Zen 5 one stream of records reads faster there, and on a Zen 4,
// which splits 512-bit instructions in halves, pairs from 2 rows up made 2 rows dearer; on an
// Intel Xeon pairs were faster from one row (figures: docs/perf/lowbit.md,
// 2026-11-30-head-and-rows.md, 2026-12-01-xeon-pairs.md).
// The dots are exact integers, as on AVX2, and lowbit_tile.h turns them into float32 with
// the same operations per output: both paths give the same bits.
//
// Everything below is compiled for AVX-512; the file uses no standard-library templates
// (see lowbit_tile.h) and no torch headers.
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")

#include "lowbit_tile.h"

namespace {

// 256-bit vectors with VNNI: one tile, for calls of few rows (see lowbit.cpp's run)
struct YV : Y {
  static LOWBIT_INLINE I dpbusd(I acc, I u, I s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static LOWBIT_INLINE I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
};

// 512-bit vectors: two tiles side by side, the second's fields `stride` bytes after the
// first's (the same record of the next tile).
struct Z {
  using I = __m512i;
  using F = __m512;
  static constexpr int TILES = 2;
  static LOWBIT_INLINE I load(const uint8_t* p, int64_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(::load(p)), ::load(p + stride), 1);
  }
  static LOWBIT_INLINE I zero() { return _mm512_setzero_si512(); }
  static LOWBIT_INLINE I bytes(char c) { return _mm512_set1_epi8(c); }
  static LOWBIT_INLINE I lanes(int32_t v) { return _mm512_set1_epi32(v); }
  static LOWBIT_INLINE I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static LOWBIT_INLINE I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static LOWBIT_INLINE I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static LOWBIT_INLINE I sub(I a, I b) { return _mm512_sub_epi32(a, b); }
  template <int N>
  static LOWBIT_INLINE I shl16(I a) { return _mm512_slli_epi16(a, N); }
  template <int N>
  static LOWBIT_INLINE I shr16(I a) { return _mm512_srli_epi16(a, N); }
  static LOWBIT_INLINE __m128i pair8(const uint8_t* p, int64_t stride) {
    return _mm_unpacklo_epi64(load8(p), load8(p + stride));
  }
  static LOWBIT_INLINE I u8(const uint8_t* p, int64_t s) {
    return _mm512_cvtepu8_epi32(pair8(p, s));
  }
  static LOWBIT_INLINE I i8(const uint8_t* p, int64_t s) {
    return _mm512_cvtepi8_epi32(pair8(p, s));
  }
  static LOWBIT_INLINE F halves(const uint8_t* p, int64_t stride) {
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(load16(p)),
                                                 load16(p + stride), 1);
    return _mm512_cvtph_ps(both);
  }
  static LOWBIT_INLINE F fzero() { return _mm512_setzero_ps(); }
  static LOWBIT_INLINE F splat(float v) { return _mm512_set1_ps(v); }
  static LOWBIT_INLINE F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static LOWBIT_INLINE F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static LOWBIT_INLINE F fsub(F a, F b) { return _mm512_sub_ps(a, b); }
  static LOWBIT_INLINE F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static LOWBIT_INLINE void store(float* out, F a) { _mm512_storeu_ps(out, a); }
  static LOWBIT_INLINE I dpbusd(I acc, I u, I s) { return _mm512_dpbusd_epi32(acc, u, s); }
  static LOWBIT_INLINE I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
};

// A block's dots are a chain of 8 vpdpbusd per row (latency ~4 cycles each). With one row
// (decode) that chain, not memory, set the pace, so groups of up to 4 rows run even and odd
// steps in two chains: with 5-7 rows in one chain each the 256-bit dots were still
// latency-bound. Groups of more rows keep one chain a row: 8 rows are 8 independent chains,
// and 8 more accumulators beside the 8 float sums did not fit the 32 registers (g++ spilled
// them). A chain may start at an exact integer offset of its row (`init`: q8's and q5's shift
// of the weights, q6's of a half) instead of zero, which saves a subtraction a row and block
// and the zeroing copy (figures: docs/perf/lowbit.md).
template <class V, int R>
struct Chains {
  static constexpr bool TWO = R <= 4;
  typename V::I odd[TWO ? R : 1];
  // d[r] = init[r] in every lane (zero where init is null) and the second chains zero;
  // returns where the odd steps' dots go
  LOWBIT_INLINE typename V::I* start(typename V::I* d, const int32_t* init = nullptr) {
    for (int r = 0; r < R; ++r) d[r] = init ? V::lanes(init[r]) : V::zero();
    if constexpr (TWO) {
      for (int r = 0; r < R; ++r) odd[r] = V::zero();
      return odd;
    }
    return d;
  }
  // each row's two chains added (exact integers, so the split changes no bits)
  LOWBIT_INLINE void join(typename V::I* d) const {
    if constexpr (TWO)
      for (int r = 0; r < R; ++r) d[r] = V::add(d[r], odd[r]);
  }
};

template <class V>
struct Q8 : lowbit::Q8Layout {
  using I = typename V::I;
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t stride, const XRows& x,
                                 const int64_t* idx, I* d) {
    int32_t init[R];  // the records hold w + 128: sum((w + 128) x) - 128 sum(x)
    for (int r = 0; r < R; ++r) init[r] = -128 * x.isum[idx[r]];
    Chains<V, R> chains;
    I* e = chains.start(d, init);
    for (int j = 0; j < 8; j += 2) {  // even and odd steps in two chains (see above)
      const I w0 = V::load(rec + WEIGHTS + 32 * j, stride);
      const I w1 = V::load(rec + WEIGHTS + 32 * j + 32, stride);
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.q + idx[r] * BLOCK;
        d[r] = V::dpbusd(d[r], w0, V::lanes(four(xr, j)));
        e[r] = V::dpbusd(e[r], w1, V::lanes(four(xr, j + 1)));
      }
    }
    chains.join(d);
  }
};

// steps 2i and 2i+1 (bytes lo, hi) into R rows' dots: the odd steps into e
template <class V, int R>
LOWBIT_INLINE void add_pair(typename V::I lo, typename V::I hi, const XRows& x,
                            const int64_t* idx, int i, typename V::I* d, typename V::I* e) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.q + idx[r] * BLOCK;
    d[r] = V::dpbusd(d[r], lo, V::lanes(four(xr, 2 * i)));
    e[r] = V::dpbusd(e[r], hi, V::lanes(four(xr, 2 * i + 1)));
  }
}

// a block's 8 steps of nibbles (q4's and q4k's arrays) with R rows: exact int32 dots
template <class V, int R>
LOWBIT_INLINE void nibble_dots(const uint8_t* nibbles, int64_t stride, const XRows& x,
                               const int64_t* idx, typename V::I* d) {
  using I = typename V::I;
  Chains<V, R> chains;
  I* e = chains.start(d);
  for (int i = 0; i < 4; ++i) {
    I lo, hi;
    nibble_pair<V>(nibbles, stride, i, lo, hi);
    add_pair<V, R>(lo, hi, x, idx, i, d, e);
  }
  chains.join(d);
}

template <class V>
struct Q4 : lowbit::Q4Layout {
  using I = typename V::I;
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t stride, const XRows& x,
                                 const int64_t* idx, I* d) {
    nibble_dots<V, R>(rec + WEIGHTS, stride, x, idx, d);
  }
};

// q4k's block dots times the block's sub-scales (`sc`: one byte per output); the same
// integers as AVX2's madd with sc in both halves of each lane
template <class V>
struct Q4K : lowbit::Q4KLayout {
  using I = typename V::I;
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* nibbles, const uint8_t* sc, int64_t stride,
                                 const XRows& x, const int64_t* idx, I* d) {
    nibble_dots<V, R>(nibbles, stride, x, idx, d);
    const I s = V::u8(sc, stride);
    for (int r = 0; r < R; ++r) d[r] = V::mullo(d[r], s);
  }
};

template <class V>
struct Q5 : lowbit::Q5Layout {
  using I = typename V::I;
  template <int P, int R>
  static LOWBIT_INLINE void pair(const uint8_t* rec, int64_t stride, I plane,
                                 const XRows& x, const int64_t* idx, I* d, I* e) {
    I lo, hi;
    q5_pair<V, P>(rec, stride, plane, lo, hi);
    add_pair<V, R>(lo, hi, x, idx, P, d, e);
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t stride, const XRows& x,
                                 const int64_t* idx, I* d) {
    const I plane = V::load(rec + PLANE, stride);
    int32_t init[R];  // q5's -16: dot - 16 sum(q_x), exact
    for (int r = 0; r < R; ++r) init[r] = -offset * x.isum[idx[r]];
    Chains<V, R> chains;
    I* e = chains.start(d, init);
    pair<0, R>(rec, stride, plane, x, idx, d, e);
    pair<1, R>(rec, stride, plane, x, idx, d, e);
    pair<2, R>(rec, stride, plane, x, idx, d, e);
    pair<3, R>(rec, stride, plane, x, idx, d, e);
    chains.join(d);
  }
};

// q6: the unsigned q (0..63) in vpdpbusd, each half (steps 4h..4h+3, one int8 sub-scale per
// output) in a chain of its own, so the two halves are the two chains. A half's exact dot
// less 32 * sum(x) over its 16 inputs is its dot with q - 32; times the sub-scale and summed,
// the same integer as AVX2's 16-bit path (|dot| < 2^24).
template <class V>
struct Q6 : lowbit::Q6Layout {
  using I = typename V::I;
  template <int H, int R>
  static LOWBIT_INLINE void half(const uint8_t* rec, int64_t stride, const XRows& x,
                                 const int64_t* idx, I* s) {
    const I plane = V::load(rec + PLANES + 32 * H, stride);
    I lo, hi;
    for (int r = 0; r < R; ++r) s[r] = offset(x, idx[r], H);  // the chain starts at -offset
    nibble_pair<V>(rec + WEIGHTS, stride, 2 * H, lo, hi);
    add_pair<V, R>(V::or_(lo, top2<V, 0>(plane)), V::or_(hi, top2<V, 1>(plane)), x, idx, 2 * H, s,
                s);
    nibble_pair<V>(rec + WEIGHTS, stride, 2 * H + 1, lo, hi);
    add_pair<V, R>(V::or_(lo, top2<V, 2>(plane)), V::or_(hi, top2<V, 3>(plane)), x, idx,
                2 * H + 1, s, s);
  }
  // -32 * x's sum over half h's 16 inputs
  static LOWBIT_INLINE I offset(const XRows& x, int64_t i, int h) {
    return V::lanes(x.halves[2 * i + h]);
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t stride, const XRows& x,
                                 const int64_t* idx, I* d) {
    I t[R];
    half<0, R>(rec, stride, x, idx, d);
    half<1, R>(rec, stride, x, idx, t);
    const I sc0 = V::i8(rec + SUBSCALES, stride), sc1 = V::i8(rec + SUBSCALES + TILE, stride);
    for (int r = 0; r < R; ++r) d[r] = V::add(V::mullo(d[r], sc0), V::mullo(t[r], sc1));
  }
};

}  // namespace

void lowbit::vnni_tile_rows(int64_t kind, const uint8_t* records, int64_t stride, int tiles,
                            const XRows& x, int64_t m0, int64_t m1, int64_t n0, int64_t n_out,
                            float* y, const float* bias) {
  if (tiles == 2)
    return kind_rows<VNNI_ROWS, Z, Q8<Z>, Q4<Z>, Q5<Z>, Q6<Z>, Q4K<Z>>(kind, records, stride, x,
                                                                       m0, m1, n0, n_out, y, bias, 2);
  kind_rows<VNNI_ROWS, YV, Q8<YV>, Q4<YV>, Q5<YV>, Q6<YV>, Q4K<YV>>(kind, records, 0, x, m0, m1,
                                                                    n0, n_out, y, bias, 1);
}
