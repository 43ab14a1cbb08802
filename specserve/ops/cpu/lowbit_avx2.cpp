// The low-bit kernels' block dots with AVX2, for every x86-64 CPU the kernels run on (Zen 1
// and later, Intel since Haswell); lowbit.cpp calls this file's `avx2_tile_rows` where the
// CPU has no AVX-512 VNNI (or SPECSERVE_CPU_ISA=avx2 asks for AVX2), and lowbit_vnni.cpp's
// otherwise. Both files walk a tile with lowbit_tile.h and give the same bits.
//
// Why a file of its own: lowbit.cpp holds what both instruction sets share (x's quantization,
// the split of a call's tiles over threads, the checks); each instruction set's dots sit
// beside each other in files of their own, as they are written for different registers.

#include "lowbit_tile.h"

namespace {

// AVX2's block dots: maddubs multiplies 32 unsigned by 32 signed bytes and adds pairs into
// 16 bits, madd adds pairs again into 32. maddubs takes an unsigned operand: q8 moves w's
// sign onto x (sign_epi8), q4/q5 weights are unsigned already (q4's low term and q5's offset
// carry the shift). One tile at a time (Y): `stride` is not used.

// 4 bytes of x (step j of a block), in every 32-bit lane
LOWBIT_INLINE __m256i broadcast4(const int8_t* x, int j) { return _mm256_set1_epi32(four(x, j)); }

struct Q8 : lowbit::Q8Layout {
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      // the records hold w + 128 (lowbit_vnni.cpp's operand): back to int8 w
      const __m256i w = _mm256_xor_si256(load(rec + WEIGHTS + 32 * j), _mm256_set1_epi8(-128));
      const __m256i wabs = _mm256_sign_epi8(w, w);
      for (int r = 0; r < R; ++r) {
        const __m256i xs = _mm256_sign_epi8(broadcast4(x.q + idx[r] * BLOCK, j), w);
        const __m256i p = _mm256_maddubs_epi16(wabs, xs);
        d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(p, ones));  // |p| <= 2 * 127^2
      }
    }
  }
};

// 16-bit sums of steps 2i and 2i+1 (bytes lo, hi: unsigned weights) for R rows, added into
// s; q4, q5 and q4k products (<= 31 * 127 each) fit 16 bits for several steps
template <int R>
LOWBIT_INLINE void sum_pair16(__m256i lo, __m256i hi, const XRows& x, const int64_t* idx, int i,
                              __m256i* s) {
  for (int r = 0; r < R; ++r) {
    const int8_t* xr = x.q + idx[r] * BLOCK;
    const __m256i a = _mm256_maddubs_epi16(lo, broadcast4(xr, 2 * i));
    const __m256i b = _mm256_maddubs_epi16(hi, broadcast4(xr, 2 * i + 1));
    s[r] = _mm256_add_epi16(s[r], _mm256_add_epi16(a, b));
  }
}

// a block's 8 steps of nibbles (q4's and q4k's arrays) with R rows, as 16-bit sums of pairs
// of steps: 2 products <= 15 * 127 each, so 8 steps fit 16 bits
template <int R>
LOWBIT_INLINE void nibble_sums16(const uint8_t* nibbles, const XRows& x, const int64_t* idx,
                                 __m256i* s) {
  for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    __m256i lo, hi;
    nibble_pair<Y>(nibbles, 0, i, lo, hi);
    sum_pair16<R>(lo, hi, x, idx, i, s);
  }
}

struct Q4 : lowbit::Q4Layout {
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    nibble_sums16<R>(rec + WEIGHTS, x, idx, d);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int r = 0; r < R; ++r) d[r] = _mm256_madd_epi16(d[r], ones);
  }
};

// q4k's block dots times the block's sub-scales (`sc`, 8 bytes: one per output): madd with
// sc in both 16-bit halves of each lane in place of q4's ones
struct Q4K : lowbit::Q4KLayout {
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* nibbles, const uint8_t* sc, int64_t,
                                 const XRows& x, const int64_t* idx, __m256i* d) {
    nibble_sums16<R>(nibbles, x, idx, d);
    const __m256i v = Y::u8(sc, 0), pairs = _mm256_or_si256(v, _mm256_slli_epi32(v, 16));
    for (int r = 0; r < R; ++r) d[r] = _mm256_madd_epi16(d[r], pairs);
  }
};

// q5's 8 steps run in 16-bit sums that may wrap: a lane's true sum of 16 products q x is up to
// 16 * 31 * 127, past int16, but less 16 times x's sums over those inputs (`pairs`, entry 2) it
// is the sum of (q - 16) x, |.| <= 16 * 16 * 127, which fits, so wrapping arithmetic gives it
// exactly, and one madd widens a row's block. (Summing 4 steps per 16-bit sum took two madds a
// row and block; the multiplies are what bind AVX2 rows, and on a Zen 1 a 256-bit madd holds
// its one multiplier pipe 2 cycles, as a maddubs does.)
struct Q5 : lowbit::Q5Layout {
  template <int I, int R>
  static LOWBIT_INLINE void pair(const uint8_t* rec, __m256i plane, const XRows& x,
                                 const int64_t* idx, __m256i* s) {
    __m256i lo, hi;
    q5_pair<Y, I>(rec, 0, plane, lo, hi);
    sum_pair16<R>(lo, hi, x, idx, I, s);
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    const __m256i plane = load(rec + PLANE), ones = _mm256_set1_epi16(1);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    pair<0, R>(rec, plane, x, idx, s);
    pair<1, R>(rec, plane, x, idx, s);
    pair<2, R>(rec, plane, x, idx, s);
    pair<3, R>(rec, plane, x, idx, s);
    for (int r = 0; r < R; ++r) {
      const __m256i off = _mm256_set1_epi32(x.pairs[lowbit::PAIRS * idx[r] + 2]);
      d[r] = _mm256_madd_epi16(_mm256_sub_epi16(s[r], off), ones);
    }
  }
};

// Step S's weights (q, 0..63, unsigned as maddubs wants them) times R rows of x, added into
// 16-bit sums. A product pair is <= 2 * 63 * 127 (no saturation); four steps' sums may wrap,
// but once q6's offset is taken off (x_offsets) the true value, |sum((q - 32) x)| <=
// 8 * 32 * 127, fits 16 bits, so wrapping arithmetic gives it exactly.
template <int S, int R>
LOWBIT_INLINE void q6_step(__m256i nib, __m256i plane, const XRows& x, const int64_t* idx,
                           __m256i* s) {
  const __m256i w = _mm256_or_si256(nib, top2<Y, S % 4>(plane));
  for (int r = 0; r < R; ++r)
    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w, broadcast4(x.q + idx[r] * BLOCK, S)));
}

// dot = sc_0 * (steps 0-3's dot) + sc_1 * (steps 4-7's): |dot| <= 2 * 128 * 16 * 32 * 127
// < 2^24, exact in float32.
struct Q6 : lowbit::Q6Layout {
  template <int H, int R>
  static LOWBIT_INLINE void half(const uint8_t* rec, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    const __m256i plane = load(rec + PLANES + 32 * H);
    __m256i s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
    __m256i lo, hi;
    nibble_pair<Y>(rec + WEIGHTS, 0, 2 * H, lo, hi);
    q6_step<4 * H, R>(lo, plane, x, idx, s);
    q6_step<4 * H + 1, R>(hi, plane, x, idx, s);
    nibble_pair<Y>(rec + WEIGHTS, 0, 2 * H + 1, lo, hi);
    q6_step<4 * H + 2, R>(lo, plane, x, idx, s);
    q6_step<4 * H + 3, R>(hi, plane, x, idx, s);
    // the 8 int8 sub-scales with each in both 16-bit halves of its lane, so that madd gives
    // each output sc * (its two 16-bit sums)
    const __m256i v = Y::i8(rec + SUBSCALES + TILE * H, 0);
    const __m256i sc = _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA);
    for (int r = 0; r < R; ++r) {
      // 32 times x's pair sums
      const __m256i off = _mm256_set1_epi32(x.pairs[lowbit::PAIRS * idx[r] + H]);
      d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(_mm256_sub_epi16(s[r], off), sc));
    }
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, int64_t, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    half<0, R>(rec, x, idx, d);
    half<1, R>(rec, x, idx, d);
  }
};

}  // namespace

void lowbit::avx2_tile_rows(int64_t kind, const uint8_t* records, const XRows& x, int64_t m0,
                            int64_t m1, int64_t n0, int64_t n_out, float* y, const float* bias) {
  kind_rows<AVX2_ROWS, Y, Q8, Q4, Q5, Q6, Q4K>(kind, records, 0, x, m0, m1, n0, n_out, y, bias, 1);
}
