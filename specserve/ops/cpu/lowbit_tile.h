// The part of the low-bit kernels that every instruction set shares: the record layouts,
// x's quantized rows as the tiles read them, and the walk over one tile's records. Each
// instruction-set file (lowbit.cpp: AVX2; lowbit_vnni.cpp: AVX-512 VNNI) includes this
// after choosing its target, defines its kinds' `dots`, and so compiles its own copy of the
// walk: the copies live in an anonymous namespace, so neither file can link to the other's
// (a shared inline function compiled with AVX-512 could otherwise be the one the linker
// keeps, and crash an AVX2 machine). Nothing here uses the standard library's templates for
// the same reason.
//
// A tile turns exact int32 block dots into float32 the same way in both files, with the same
// operations in the same order (cvt, mul, fma; -ffp-contract=off), so the two instruction
// sets give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// Every helper of the tile walk is forced inline. Left to itself, g++ -O3 kept the block
// dots of 1-6 rows as functions of their own (those of 7 and 8 rows it inlined), so each
// record's dots went through a call and their results through memory: an L2-resident q5
// record took 5.6 ns at one row and 19.1 ns at five, against 4.3 and 10.6 inlined (one
// thread, Zen 4), and five rows cost more than seven.
#define LOWBIT_INLINE inline __attribute__((always_inline))

namespace lowbit {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 8;
constexpr int64_t SCALES = TILE * 2;  // bytes of one float16 field of a record
// prefetch this many bytes ahead of the record being read (4 q8 records)
constexpr int64_t PREFETCH = 1152;

// x quantized per row in blocks of 32 (see quantize_rows in lowbit.cpp), as plain pointers.
struct XRows {
  const int8_t* q;      // [M, K]: x ~ d * q
  const uint8_t* u;     // q + 128 as unsigned bytes (the VNNI q8 path's operand), or null
  const float* d;       // [M, K/32]
  const float* sum;     // d * sum(q) per block: q4's low term
  const int32_t* isum;  // sum(q) per block: q5's offset term
  const int32_t* pairs;  // [M, K/32, 2]: q6's offset per 16 inputs (q6_offsets)
  int64_t nblocks;
};

// Where each kind's fields sit in its record (models/layers/lowbit.py writes them).
struct Q8Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = SCALES;
  static constexpr int64_t RECORD = WEIGHTS + TILE * BLOCK;
  static constexpr bool has_low = false;
};
struct Q4Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = 2 * SCALES;
  static constexpr int64_t RECORD = WEIGHTS + TILE * BLOCK / 2;
  static constexpr bool has_low = true;
};
struct Q5Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = SCALES;
  static constexpr int64_t PLANE = WEIGHTS + TILE * BLOCK / 2;  // the fifth bits
  static constexpr int64_t RECORD = PLANE + 32;
  static constexpr bool has_low = false;
  static constexpr int32_t offset = 16;
};
// q6 (GGUF Q6_K's own values): w = d * sc * (q - 32), q 0..63, an int8 sc per 16 inputs
// (steps 0-3 and 4-7 of a block) and d per output; the low 4 bits as q4's nibble arrays,
// the top 2 in two planes (plane h: bits 2j, 2j+1 of byte i are step 4h+j's byte i).
struct Q6Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t SUBSCALES = SCALES;         // int8 sc[2][8]
  static constexpr int64_t WEIGHTS = 2 * SCALES;       // the nibble arrays
  static constexpr int64_t PLANES = WEIGHTS + TILE * BLOCK / 2;
  static constexpr int64_t RECORD = PLANES + 64;
  static constexpr bool has_low = false;
};

// q4k (GGUF Q4_K's own values): w = d * sc * q - dmin * m, q 0..15, sc and m 6-bit integers per
// block of 32, d and dmin per 256 inputs. One record covers a whole super-block of 256 inputs,
// so d and dmin are stored once per 8 blocks (0.578 bytes per weight; q4 with float16 scale and
// low per block: 0.625).
struct Q4KLayout {
  static constexpr int64_t INPUTS = 8 * BLOCK;
  static constexpr int64_t DMIN = SCALES;                // half dmin[8] (after half d[8])
  static constexpr int64_t SC = 2 * SCALES;              // uint8 sc[8 blocks][8 outputs]
  static constexpr int64_t MINS = SC + 8 * TILE;         // uint8 m[8 blocks][8 outputs]
  static constexpr int64_t WEIGHTS = MINS + 8 * TILE;    // q4's nibble arrays, 128 bytes a block
  static constexpr int64_t RECORD = WEIGHTS + 8 * TILE * BLOCK / 2;
};

// Rows m0..m1 of tile `t` of one matrix of `kind` with the AVX-512 VNNI kinds (defined in
// lowbit_vnni.cpp, which is compiled for those instructions; call only where the CPU has them).
void vnni_tile_rows(int64_t kind, const uint8_t* records, const XRows& x, int64_t m0, int64_t m1,
                    int64_t n0, int64_t n_out, float* y, const float* bias);

}  // namespace lowbit

namespace {

using lowbit::BLOCK;
using lowbit::TILE;
using lowbit::XRows;

LOWBIT_INLINE __m256i load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 4 bytes of x (step j of a block), in every 32-bit lane
template <class T>
LOWBIT_INLINE __m256i broadcast4(const T* x, int j) {
  int32_t v;
  std::memcpy(&v, x + 4 * j, 4);
  return _mm256_set1_epi32(v);
}

// 8 float16 values at p as 8 float32 lanes (exact)
LOWBIT_INLINE __m256 halves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Steps 2i and 2i+1 of a record's i-th nibble array, as bytes 0..15.
LOWBIT_INLINE void nibble_pair(const uint8_t* nibbles, int i, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F), p = load(nibbles + 32 * i);
  lo = _mm256_and_si256(p, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), mask);
}

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

// Bit J of each byte of the fifth-bit plane, moved to bit 4 (the value 16).
template <int J>
LOWBIT_INLINE __m256i fifth(__m256i plane) {
  const __m256i sixteen = _mm256_set1_epi8(16);
  // 16-bit shifts: bit J of either byte of a lane lands on bit 4 of the same byte
  if constexpr (J < 4) return _mm256_and_si256(_mm256_slli_epi16(plane, 4 - J), sixteen);
  else if constexpr (J == 4) return _mm256_and_si256(plane, sixteen);
  else return _mm256_and_si256(_mm256_srli_epi16(plane, J - 4), sixteen);
}

// q5 pair i's two steps as bytes 0..31: nibbles plus the fifth bits
template <int I>
LOWBIT_INLINE void q5_pair(const uint8_t* rec, __m256i plane, __m256i& lo, __m256i& hi) {
  nibble_pair(rec + lowbit::Q5Layout::WEIGHTS, I, lo, hi);
  lo = _mm256_or_si256(lo, fifth<2 * I>(plane));
  hi = _mm256_or_si256(hi, fifth<2 * I + 1>(plane));
}

// q5's -16: dot - 16 sum(q_x), exact (|dot| < 2^24)
template <int R>
LOWBIT_INLINE void q5_offset(const XRows& x, const int64_t* idx, __m256i* d) {
  for (int r = 0; r < R; ++r)
    d[r] = _mm256_sub_epi32(d[r], _mm256_set1_epi32(lowbit::Q5Layout::offset * x.isum[idx[r]]));
}

// The top 2 bits of step 4h+J's bytes (bits 2J, 2J+1 of plane h) moved to bits 4-5.
template <int J>
LOWBIT_INLINE __m256i top2(__m256i plane) {
  const __m256i mask = _mm256_set1_epi8(0x30);
  // 16-bit shifts: what crosses into the other byte of a lane lands outside bits 4-5
  if constexpr (J < 2) return _mm256_and_si256(_mm256_slli_epi16(plane, 4 - 2 * J), mask);
  else if constexpr (J == 2) return _mm256_and_si256(plane, mask);
  else return _mm256_and_si256(_mm256_srli_epi16(plane, 2 * J - 4), mask);
}

// 8 int8 sub-scales at p as 32-bit lanes holding the scale in both 16-bit halves, so that
// madd(s, pairs) gives each output sc * (its two 16-bit sums)
LOWBIT_INLINE __m256i scale_pairs(const uint8_t* p) {
  const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_blend_epi16(v, _mm256_slli_epi32(v, 16), 0xAA);
}

// Step S's weights (q, 0..63, unsigned as maddubs wants them) times R rows of x, added into
// 16-bit sums. A product pair is <= 2 * 63 * 127 (no saturation); four steps' sums may wrap,
// but once q6's offset is taken off (q6_offsets) the true value, |sum((q - 32) x)| <=
// 8 * 32 * 127, fits 16 bits, so wrapping arithmetic gives it exactly.
template <int S, int R>
LOWBIT_INLINE void q6_step(__m256i nib, __m256i plane, const XRows& x, const int64_t* idx,
                           __m256i* s) {
  const __m256i w = _mm256_or_si256(nib, top2<S % 4>(plane));
  for (int r = 0; r < R; ++r)
    s[r] = _mm256_add_epi16(s[r], _mm256_maddubs_epi16(w, broadcast4(x.q + idx[r] * BLOCK, S)));
}

// AVX2 instructions only, so the AVX2 and VNNI files both run these dots (same integers).
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
    nibble_pair(rec + WEIGHTS, 2 * H, lo, hi);
    q6_step<4 * H, R>(lo, plane, x, idx, s);
    q6_step<4 * H + 1, R>(hi, plane, x, idx, s);
    nibble_pair(rec + WEIGHTS, 2 * H + 1, lo, hi);
    q6_step<4 * H + 2, R>(lo, plane, x, idx, s);
    q6_step<4 * H + 3, R>(hi, plane, x, idx, s);
    const __m256i sc = scale_pairs(rec + SUBSCALES + TILE * H);
    for (int r = 0; r < R; ++r) {
      const __m256i off = _mm256_set1_epi32(x.pairs[2 * idx[r] + H]);  // 32 * x's pair sums
      d[r] = _mm256_add_epi32(d[r], _mm256_madd_epi16(_mm256_sub_epi16(s[r], off), sc));
    }
  }
  template <int R>
  static LOWBIT_INLINE void dots(const uint8_t* rec, const XRows& x, const int64_t* idx,
                                 __m256i* d) {
    for (int r = 0; r < R; ++r) d[r] = _mm256_setzero_si256();
    half<0, R>(rec, x, idx, d);
    half<1, R>(rec, x, idx, d);
  }
};

// Row r's 8 outputs (acc[r]) into y, plus bias; a padded last tile writes only its real ones.
template <int R>
LOWBIT_INLINE void store_rows(const __m256* acc, int64_t m0, int64_t n0, int64_t n_out, float* y,
                              const float* bias) {
  const int64_t valid = n_out - n0 < TILE ? n_out - n0 : TILE;
  for (int r = 0; r < R; ++r) {
    alignas(32) float out[TILE];
    _mm256_store_ps(out, acc[r]);
    float* row = y + (m0 + r) * n_out + n0;
    for (int c = 0; c < valid; ++c) row[c] = out[c] + (bias ? bias[n0 + c] : 0.0f);
  }
}

// y[m0 .. m0+R, n0 .. n0+8) from one tile's records; row r's 8 outputs are one __m256.
// W::dots gives the exact int32 block dots of the record's 8 outputs with R rows' blocks
// (`idx`: each row's block index in x).
template <int R, class W>
LOWBIT_INLINE void tile(const uint8_t* records, const XRows& x, int64_t m0, int64_t n0,
                        int64_t n_out, float* y, const float* bias) {
  const int64_t nb = x.nblocks;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* rec = records + b * W::RECORD;
    for (int64_t off = 0; off < W::RECORD; off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + lowbit::PREFETCH + off), _MM_HINT_T0);
    int64_t idx[R];
    for (int r = 0; r < R; ++r) idx[r] = (m0 + r) * nb + b;
    __m256i dot[R];
    W::template dots<R>(rec, x, idx, dot);
    const __m256 scale = halves(rec);
    for (int r = 0; r < R; ++r) {
      const __m256 d = _mm256_cvtepi32_ps(dot[r]);  // exact: |dot| < 2^24
      acc[r] = _mm256_fmadd_ps(d, _mm256_mul_ps(scale, _mm256_set1_ps(x.d[idx[r]])), acc[r]);
      if constexpr (W::has_low)
        acc[r] = _mm256_fmadd_ps(halves(rec + lowbit::SCALES), _mm256_set1_ps(x.sum[idx[r]]),
                                 acc[r]);
    }
  }
  store_rows<R>(acc, m0, n0, n_out, y, bias);
}

// 8 uint8 values at p as 32-bit lanes
LOWBIT_INLINE __m256i bytes_u32(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// y[m0 .. m0+R, n0 .. n0+8) from one tile's q4k records (whole super-blocks of 256 inputs). Per
// block: the exact int32 dot sc * sum(q q_x) (madd with sc in both halves of each lane, in place
// of q4's madd with ones; |dot| <= 63 * 32 * 15 * 127 < 2^24), then acc = fma(dot, d * d_x,
// acc) and acc = fma(-(dmin * m), d_x * sum(q_x), acc): the float steps of `tile` with d and
// -(dmin * m) (exact in float32) for q4's scale and low.
template <int R>
LOWBIT_INLINE void q4k_tile(const uint8_t* records, const XRows& x, int64_t m0, int64_t n0,
                            int64_t n_out, float* y, const float* bias) {
  using L = lowbit::Q4KLayout;
  const int64_t nb = x.nblocks;
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* rec = records + sb * L::RECORD;
    for (int64_t off = 0; off < L::WEIGHTS; off += 64)  // the next record's scales
      _mm_prefetch(reinterpret_cast<const char*>(rec + L::RECORD + off), _MM_HINT_T0);
    const __m256 d = halves(rec), dmin = halves(rec + L::DMIN);
    for (int b = 0; b < 8; ++b) {
      const uint8_t* nib = rec + L::WEIGHTS + b * TILE * BLOCK / 2;
      for (int64_t off = 0; off < TILE * BLOCK / 2; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(nib + lowbit::PREFETCH + off), _MM_HINT_T0);
      int64_t idx[R];
      for (int r = 0; r < R; ++r) idx[r] = (m0 + r) * nb + sb * 8 + b;
      __m256i s[R];
      for (int r = 0; r < R; ++r) s[r] = _mm256_setzero_si256();
      for (int i = 0; i < 4; ++i) {  // 8 steps of 2 products <= 15 * 127: fits 16 bits
        __m256i lo, hi;
        nibble_pair(nib, i, lo, hi);
        sum_pair16<R>(lo, hi, x, idx, i, s);
      }
      const __m256i sc = bytes_u32(rec + L::SC + b * TILE);
      const __m256i pairs = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
      const __m256 m = _mm256_cvtepi32_ps(bytes_u32(rec + L::MINS + b * TILE));
      const __m256 low = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, m));
      for (int r = 0; r < R; ++r) {
        const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(s[r], pairs));
        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(x.d[idx[r]])), acc[r]);
        acc[r] = _mm256_fmadd_ps(low, _mm256_set1_ps(x.sum[idx[r]]), acc[r]);
      }
    }
  }
  store_rows<R>(acc, m0, n0, n_out, y, bias);
}

// Rows m_begin..m_end of one tile, R rows at a time, the last group smaller (R-1 .. 1).
template <int R, class W>
LOWBIT_INLINE void rows(const uint8_t* records, const XRows& x, int64_t m_begin, int64_t m_end,
                        int64_t n0, int64_t n_out, float* y, const float* bias) {
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) {
    if constexpr (W::INPUTS == lowbit::Q4KLayout::INPUTS)
      q4k_tile<R>(records, x, m, n0, n_out, y, bias);
    else
      tile<R, W>(records, x, m, n0, n_out, y, bias);
  }
  if constexpr (R > 1) {
    if (m < m_end) rows<R - 1, W>(records, x, m, m_end, n0, n_out, y, bias);
  }
}

// One tile of a matrix of `kind` (0 q8, 1 q4, 2 q5, 3 q6, 4 q4k), up to ROWS rows sharing each
// record read.
template <int ROWS, class Q8, class Q4, class Q5>
LOWBIT_INLINE void kind_rows(int64_t kind, const uint8_t* rec, const XRows& x, int64_t m0,
                             int64_t m1, int64_t n0, int64_t n_out, float* y, const float* bias) {
  switch (kind) {
    case 0: return rows<ROWS, Q8>(rec, x, m0, m1, n0, n_out, y, bias);
    case 1: return rows<ROWS, Q4>(rec, x, m0, m1, n0, n_out, y, bias);
    case 2: return rows<ROWS, Q5>(rec, x, m0, m1, n0, n_out, y, bias);
    case 3: return rows<ROWS, Q6>(rec, x, m0, m1, n0, n_out, y, bias);
    default: return rows<ROWS, lowbit::Q4KLayout>(rec, x, m0, m1, n0, n_out, y, bias);
  }
}

}  // namespace
