// The part of the low-bit kernels that every instruction set shares: the record layouts,
// x's quantized rows as the tiles read them, the bit unpacking and the walk over a tile's
// records, written once for a vector type V (Y here: 256 bits, one tile of 8 outputs; Z in
// lowbit_vnni.cpp: 512 bits, two tiles side by side). Each instruction-set file (lowbit.cpp:
// AVX2; lowbit_vnni.cpp: AVX-512 VNNI) includes this after choosing its target, defines its
// kinds' `dots`, and so compiles its own copy of the walk: the copies live in an anonymous
// namespace, so neither file can link to the other's (a shared inline function compiled with
// AVX-512 could otherwise be the one the linker keeps, and crash an AVX2 machine). Nothing
// here uses the standard library's templates for the same reason.
//
// A tile turns exact int32 block dots into float32 the same way in every file and width,
// with the same operations per output in the same order (cvt, mul, fma; -ffp-contract=off),
// so the instruction sets give the same bits.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// Every helper of the tile walk is forced inline. Left to itself, g++ -O3 kept the block
// dots of 1-6 rows as functions of their own (those of 7 and 8 rows it inlined), so each
// record's dots went through a call and their results through memory, and five rows cost
// more than seven (figures: docs/perf/lowbit.md).
#define LOWBIT_INLINE inline __attribute__((always_inline))

namespace lowbit {

constexpr int64_t BLOCK = 32;
constexpr int64_t TILE = 8;
constexpr int64_t SCALES = TILE * 2;  // bytes of one float16 field of a record
// prefetch this many bytes ahead of the record being read: about what one core has in flight
// at full bandwidth (bandwidth x memory latency); a few records ahead was too short, and a
// one-row forward waited on memory (figures: docs/perf/lowbit.md).
constexpr int64_t PREFETCH = 8192;

// AVX2's int16-pair offsets per block of x (x_offsets in lowbit.cpp): q6's two halves, then q5's
constexpr int64_t PAIRS = 3;

// x quantized per row in blocks of 32 (quantize_range in lowbit.cpp), as plain pointers.
// Block-major: block b of row m is entry b * rows + m of every array (`at`), so a group's
// rows of one block sit side by side and the walk reaches them from one pointer at fixed
// offsets; row-major, each row took a register of its own, and g++ spilled the rest (figures:
// docs/perf/lowbit.md).
struct XRows {
  const int8_t* q;       // [K/32, M, 32]: x ~ d * q
  const float* d;        // [K/32, M]
  const float* sum;      // d * sum(q) per block: q4's low term
  const int32_t* isum;   // sum(q) per block: VNNI q5's and q8's offset terms
  const int32_t* pairs;  // [K/32, M, PAIRS]: AVX2 q6's offsets per 16 inputs, q5's (x_offsets)
  const int32_t* halves;  // [K/32, M, 2]: VNNI q6's, -32 sum(q) per 16 inputs
  int64_t nblocks, rows;
  // the index of row m's block b
  LOWBIT_INLINE int64_t at(int64_t m, int64_t b) const { return b * rows + m; }
};

// Where each kind's fields sit in its record (ops/fast/lowbit.py writes them; ops/naive/lowbit.py
// reads them back plainly).
struct Q8Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = SCALES;
  static constexpr int64_t RECORD = WEIGHTS + TILE * BLOCK;
  static constexpr bool has_low = false;
  static constexpr bool own_walk = false;  // `tile` walks it
};
struct Q4Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = 2 * SCALES;
  static constexpr int64_t RECORD = WEIGHTS + TILE * BLOCK / 2;
  static constexpr bool has_low = true;
  static constexpr bool own_walk = false;  // `tile` walks it
};
struct Q5Layout {
  static constexpr int64_t INPUTS = BLOCK;  // x's inputs one record covers
  static constexpr int64_t WEIGHTS = SCALES;
  static constexpr int64_t PLANE = WEIGHTS + TILE * BLOCK / 2;  // the fifth bits
  static constexpr int64_t RECORD = PLANE + 32;
  static constexpr bool has_low = false;
  static constexpr bool own_walk = false;  // `tile` walks it
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
  static constexpr bool own_walk = false;  // `tile` walks it
};

// q6k (GGUF Q6_K's own layout): q6's values with d once per super-block of 256 inputs, as the
// file has it: per tile and 256 inputs, half d[8], then each block's q6 record less its d
// (sc, nibble arrays, planes: 208 bytes). 0.820 bytes per weight (Q6_K's own figure) against
// q6's 0.875, which repeats d in every block of 32; the 1.5B's Q6_K weights read 24 MB less
// per token. `Q6` is an instruction set's q6 block dots, which read a block's fields at q6's
// offsets (so the walk hands them the block's bytes less SCALES).
template <class Q6>
struct Q6K : Q6 {
  static constexpr int64_t INPUTS = 8 * BLOCK;
  static constexpr int64_t BLOCK_BYTES = Q6::RECORD - SCALES;
  static constexpr int64_t RECORD = SCALES + 8 * BLOCK_BYTES;
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
  static constexpr bool own_walk = true;  // q4k_tile walks it
};

// Rows m0..m1 of `tiles` (1 or 2) neighbouring tiles of one matrix of `kind` (the second's
// records `stride` bytes after the first's) with the AVX-512 VNNI kinds (defined in
// lowbit_vnni.cpp, which is compiled for those instructions; call only where the CPU has them).
void vnni_tile_rows(int64_t kind, const uint8_t* records, int64_t stride, int tiles,
                    const XRows& x, int64_t m0, int64_t m1, int64_t n0, int64_t n_out, float* y,
                    const float* bias);

// rows sharing each weight record read (verification rows, prefill): AVX2 has 16 vector
// registers, enough for 4 rows' accumulators and dots; AVX-512 has 32, enough for 8
constexpr int AVX2_ROWS = 4;
constexpr int VNNI_ROWS = 8;

// Rows m0..m1 of one tile of `kind` with AVX2 (defined in lowbit_avx2.cpp).
void avx2_tile_rows(int64_t kind, const uint8_t* records, const XRows& x, int64_t m0, int64_t m1,
                    int64_t n0, int64_t n_out, float* y, const float* bias);

}  // namespace lowbit

namespace {

using lowbit::BLOCK;
using lowbit::TILE;
using lowbit::XRows;

LOWBIT_INLINE __m256i load(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

LOWBIT_INLINE __m128i load8(const uint8_t* p) {
  return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
}

LOWBIT_INLINE __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// 4 bytes of x (step j of a block) as one 32-bit integer
template <class T>
LOWBIT_INLINE int32_t four(const T* x, int j) {
  int32_t v;
  std::memcpy(&v, x + 4 * j, 4);
  return v;
}

// 256-bit vectors: one tile, 8 outputs (a 32-bit lane each). A record field at p is read as
// one vector; `stride` (where Z finds the second tile's record) is not used.
struct Y {
  using I = __m256i;
  using F = __m256;
  static constexpr int TILES = 1;
  static LOWBIT_INLINE I load(const uint8_t* p, int64_t) { return ::load(p); }
  static LOWBIT_INLINE I zero() { return _mm256_setzero_si256(); }
  static LOWBIT_INLINE I bytes(char c) { return _mm256_set1_epi8(c); }
  static LOWBIT_INLINE I lanes(int32_t v) { return _mm256_set1_epi32(v); }
  static LOWBIT_INLINE I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static LOWBIT_INLINE I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static LOWBIT_INLINE I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static LOWBIT_INLINE I sub(I a, I b) { return _mm256_sub_epi32(a, b); }
  template <int N>
  static LOWBIT_INLINE I shl16(I a) { return _mm256_slli_epi16(a, N); }
  template <int N>
  static LOWBIT_INLINE I shr16(I a) { return _mm256_srli_epi16(a, N); }
  // 8 uint8 / int8 values at p as 32-bit lanes
  static LOWBIT_INLINE I u8(const uint8_t* p, int64_t) { return _mm256_cvtepu8_epi32(load8(p)); }
  static LOWBIT_INLINE I i8(const uint8_t* p, int64_t) { return _mm256_cvtepi8_epi32(load8(p)); }
  // 8 float16 values at p as float32 lanes (exact)
  static LOWBIT_INLINE F halves(const uint8_t* p, int64_t) { return _mm256_cvtph_ps(load16(p)); }
  static LOWBIT_INLINE F fzero() { return _mm256_setzero_ps(); }
  static LOWBIT_INLINE F splat(float v) { return _mm256_set1_ps(v); }
  static LOWBIT_INLINE F cvt(I a) { return _mm256_cvtepi32_ps(a); }
  static LOWBIT_INLINE F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static LOWBIT_INLINE F fsub(F a, F b) { return _mm256_sub_ps(a, b); }
  static LOWBIT_INLINE F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static LOWBIT_INLINE void store(float* out, F a) { _mm256_storeu_ps(out, a); }
};

// Steps 2i and 2i+1 of a record's i-th nibble array, as bytes 0..15.
template <class V>
LOWBIT_INLINE void nibble_pair(const uint8_t* nibbles, int64_t stride, int i, typename V::I& lo,
                               typename V::I& hi) {
  const typename V::I mask = V::bytes(0x0F), p = V::load(nibbles + 32 * i, stride);
  lo = V::and_(p, mask);
  hi = V::and_(V::template shr16<4>(p), mask);
}

// Bit J of each byte of the fifth-bit plane, moved to bit 4 (the value 16).
template <class V, int J>
LOWBIT_INLINE typename V::I fifth(typename V::I plane) {
  const typename V::I sixteen = V::bytes(16);
  // 16-bit shifts: bit J of either byte of a lane lands on bit 4 of the same byte
  if constexpr (J < 4) return V::and_(V::template shl16<4 - J>(plane), sixteen);
  else if constexpr (J == 4) return V::and_(plane, sixteen);
  else return V::and_(V::template shr16<J - 4>(plane), sixteen);
}

// q5 pair i's two steps as bytes 0..31: nibbles plus the fifth bits
template <class V, int I>
LOWBIT_INLINE void q5_pair(const uint8_t* rec, int64_t stride, typename V::I plane,
                           typename V::I& lo, typename V::I& hi) {
  nibble_pair<V>(rec + lowbit::Q5Layout::WEIGHTS, stride, I, lo, hi);
  lo = V::or_(lo, fifth<V, 2 * I>(plane));
  hi = V::or_(hi, fifth<V, 2 * I + 1>(plane));
}

// The top 2 bits of step 4h+J's bytes (bits 2J, 2J+1 of plane h) moved to bits 4-5.
template <class V, int J>
LOWBIT_INLINE typename V::I top2(typename V::I plane) {
  const typename V::I mask = V::bytes(0x30);
  // 16-bit shifts: what crosses into the other byte of a lane lands outside bits 4-5
  if constexpr (J < 2) return V::and_(V::template shl16<4 - 2 * J>(plane), mask);
  else if constexpr (J == 2) return V::and_(plane, mask);
  else return V::and_(V::template shr16<2 * J - 4>(plane), mask);
}

// Row r's outputs (acc[r]: `tiles` tiles of 8 from n0) into y, plus bias; a padded last tile
// writes only its real ones.
template <int R, class V>
LOWBIT_INLINE void store_rows(const typename V::F* acc, int64_t m0, int64_t n0, int64_t n_out,
                              float* y, const float* bias, int tiles) {
  for (int r = 0; r < R; ++r) {
    float out[TILE * V::TILES];
    V::store(out, acc[r]);
    float* row = y + (m0 + r) * n_out;
    for (int c = 0; c < TILE * tiles && n0 + c < n_out; ++c)
      row[n0 + c] = out[c] + (bias ? bias[n0 + c] : 0.0f);
  }
}

// The walk's look-ahead: prefetches what it will read a fixed distance on. A tile's records
// are followed by the next tile's, so a lone tile's look-ahead runs on into the next tile,
// which the next call reads. Two tiles side by side (t, t + 1) are two streams, and the next
// call takes t + 2 and t + 3: past the end of its tile each stream's look-ahead skips the
// partner tile. (It ran on into t + 1, read already, and t + 3 was never prefetched: every
// second tile went unfetched; figures: docs/perf/lowbit.md.)
template <class V>
struct Ahead {
  const uint8_t* at;  // stream 0's next look-ahead; stream 1's is a stride on
  int64_t stride;
  int64_t left;  // bytes from `at` to the end of its tile (pairs only)

  // off: the offset, from `records`, of the first byte to prefetch
  LOWBIT_INLINE Ahead(const uint8_t* records, int64_t stride_, int64_t off) : stride(stride_) {
    if constexpr (V::TILES == 1) {
      at = records + off;
      left = 0;
    } else {
      const int64_t pair = off / stride, within = off - pair * stride;
      at = records + 2 * pair * stride + within;
      left = stride - within;
    }
  }

  // prefetch `bytes` at the look-ahead (in both tiles), then move it `step` bytes on. A lone
  // tile (1-3 rows: bound by memory) prefetches into L1; two tiles (4 rows up: bound by the
  // multiplies) into L2 only: two streams 8 KB ahead are half of a Zen 4's 32 KB L1, and
  // lines left it before their turn (so it seems); one row into L2 was slower (figures:
  // docs/perf/lowbit.md).
  LOWBIT_INLINE void next(int64_t bytes, int64_t step) {
    for (int64_t off = 0; off < bytes; off += 64) {
      if constexpr (V::TILES == 1) {
        _mm_prefetch(reinterpret_cast<const char*>(at + off), _MM_HINT_T0);
      } else {
        _mm_prefetch(reinterpret_cast<const char*>(at + off), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(at + stride + off), _MM_HINT_T1);
      }
    }
    at += step;
    if constexpr (V::TILES == 2) {
      left -= step;
      if (left <= 0) {  // into the next pair: over the partner tile
        at += stride;
        left += stride;
      }
    }
  }
};

// Where block j of a record has its fields, as W::dots reads them: the record itself, or in
// q6k's, block j's q6 record less its d (so at q6's offsets from SCALES bytes before it)
template <class W>
LOWBIT_INLINE const uint8_t* block_fields(const uint8_t* record, int64_t j) {
  if constexpr (W::INPUTS > BLOCK) return record + j * W::BLOCK_BYTES;
  else return record;
}

// y[m0 .. m0+R, n0 .. n0+8*tiles) from the tiles' records; row r's outputs are one V::F.
// W::dots gives the exact int32 block dots of the records' outputs with R rows' blocks
// (`idx`: each row's block index in x). A record covers one block, or q6k's 8 blocks under
// one d: those 8 dots are summed as integers (x has one scale per 256 inputs there, run's
// per_group; |sum| <= 8 * 2 * 128 * 16 * 32 * 127 < 2^31) before the float step, which runs
// once a record: at 8 rows the float steps were a quarter of a block's instructions.
template <int R, class V, class W>
LOWBIT_INLINE void tile(const uint8_t* records, int64_t stride, const XRows& x, int64_t m0,
                        int64_t n0, int64_t n_out, float* y, const float* bias, int tiles) {
  constexpr int64_t per = W::INPUTS / BLOCK;      // blocks a record covers
  constexpr int64_t per_block = W::RECORD / per;  // a block's share of it (the look-ahead)
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  Ahead<V> ahead(records, stride, lowbit::PREFETCH);
  for (int64_t s = 0; s < x.nblocks / per; ++s) {
    const uint8_t* scales = records + s * W::RECORD;  // d (or s) and q4's low lead the record
    const int64_t first = x.at(m0, s * per);  // the group's rows follow it (as one base + r)
    typename V::I sum[R];
    for (int64_t j = 0; j < per; ++j) {
      const uint8_t* rec = block_fields<W>(scales, j);
      ahead.next(per_block, per_block);
      int64_t idx[R];
      const int64_t at = x.at(m0, s * per + j);
      for (int r = 0; r < R; ++r) idx[r] = at + r;
      typename V::I dot[R];
      W::template dots<R>(rec, stride, x, idx, dot);
      for (int r = 0; r < R; ++r) sum[r] = j ? V::add(sum[r], dot[r]) : dot[r];
    }
    const typename V::F scale = V::halves(scales, stride);
    for (int r = 0; r < R; ++r) {
      // exact for a block's dot (< 2^24); a q6k sum may round, the same on every ISA
      const typename V::F d = V::cvt(sum[r]);
      acc[r] = V::fmadd(d, V::mul(scale, V::splat(x.d[first + r])), acc[r]);
      if constexpr (W::has_low)
        acc[r] = V::fmadd(V::halves(scales + lowbit::SCALES, stride),
                          V::splat(x.sum[first + r]), acc[r]);
    }
  }
  store_rows<R, V>(acc, m0, n0, n_out, y, bias, tiles);
}

// y[m0 .. m0+R, n0 .. n0+8*tiles) from the tiles' q4k records (whole super-blocks of 256
// inputs, under one scale of x: run's per_group). Per block: K::dots gives the exact int32 dot
// sc * sum(q q_x), summed over the super-block as integers (|sum| <= 8 * 63 * 32 * 15 * 127 <
// 2^31), and acc = fma(-(dmin * m), d_x * sum(q_x), acc); per super-block acc = fma(sum, d *
// d_x, acc) (the conversion may round a sum past 2^24, the same on every ISA). One float step
// per super-block, not per block as q4's, saves instructions at many rows (figures:
// docs/perf/lowbit.md).
template <int R, class V, class K>
LOWBIT_INLINE void q4k_tile(const uint8_t* records, int64_t stride, const XRows& x, int64_t m0,
                            int64_t n0, int64_t n_out, float* y, const float* bias, int tiles) {
  const int64_t nb = x.nblocks;
  typename V::F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = V::fzero();
  // the next record's scales, and the nibbles a distance on
  Ahead<V> scales(records, stride, K::RECORD);
  Ahead<V> nibbles(records, stride, K::WEIGHTS + lowbit::PREFETCH);
  for (int64_t sb = 0; sb < nb / 8; ++sb) {
    const uint8_t* rec = records + sb * K::RECORD;
    scales.next(K::WEIGHTS, K::RECORD);
    const typename V::F dmin = V::halves(rec + K::DMIN, stride);
    typename V::I sum[R];
    for (int b = 0; b < 8; ++b) {
      const uint8_t* nib = rec + K::WEIGHTS + b * TILE * BLOCK / 2;
      // the last block's step also passes the next record's scales
      nibbles.next(TILE * BLOCK / 2, TILE * BLOCK / 2 + (b == 7 ? K::WEIGHTS : 0));
      int64_t idx[R];
      const int64_t first = x.at(m0, sb * 8 + b);
      for (int r = 0; r < R; ++r) idx[r] = first + r;
      typename V::I dots[R];
      K::template dots<R>(nib, rec + K::SC + b * TILE, stride, x, idx, dots);
      const typename V::F m = V::cvt(V::u8(rec + K::MINS + b * TILE, stride));
      const typename V::F low = V::fsub(V::fzero(), V::mul(dmin, m));
      for (int r = 0; r < R; ++r) {
        sum[r] = b ? V::add(sum[r], dots[r]) : dots[r];
        acc[r] = V::fmadd(low, V::splat(x.sum[idx[r]]), acc[r]);
      }
    }
    const typename V::F d = V::halves(rec, stride);
    const int64_t first = x.at(m0, sb * 8);
    for (int r = 0; r < R; ++r)
      acc[r] = V::fmadd(V::cvt(sum[r]), V::mul(d, V::splat(x.d[first + r])), acc[r]);
  }
  store_rows<R, V>(acc, m0, n0, n_out, y, bias, tiles);
}

// Rows m_begin..m_end of the tiles, R rows at a time, the last group smaller (R-1 .. 1).
template <int R, class V, class W>
LOWBIT_INLINE void rows(const uint8_t* records, int64_t stride, const XRows& x, int64_t m_begin,
                        int64_t m_end, int64_t n0, int64_t n_out, float* y, const float* bias,
                        int tiles) {
  int64_t m = m_begin;
  for (; m + R <= m_end; m += R) {
    if constexpr (W::own_walk)
      q4k_tile<R, V, W>(records, stride, x, m, n0, n_out, y, bias, tiles);
    else
      tile<R, V, W>(records, stride, x, m, n0, n_out, y, bias, tiles);
  }
  if constexpr (R > 1) {
    if (m < m_end) rows<R - 1, V, W>(records, stride, x, m, m_end, n0, n_out, y, bias, tiles);
  }
}

// The tiles of a matrix of `kind` (0 q8, 1 q4, 2 q5, 3 q6, 4 q4k, 5 q6k), up to ROWS rows sharing each
// record read; each instruction-set file passes its vector type and its own kinds' dots.
template <int ROWS, class V, class Q8, class Q4, class Q5, class Q6, class Q4K>
LOWBIT_INLINE void kind_rows(int64_t kind, const uint8_t* rec, int64_t stride, const XRows& x,
                             int64_t m0, int64_t m1, int64_t n0, int64_t n_out, float* y,
                             const float* bias, int tiles) {
  switch (kind) {
    case 0: return rows<ROWS, V, Q8>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
    case 1: return rows<ROWS, V, Q4>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
    case 2: return rows<ROWS, V, Q5>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
    case 3: return rows<ROWS, V, Q6>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
    case 4: return rows<ROWS, V, Q4K>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
    default: return rows<ROWS, V, lowbit::Q6K<Q6>>(rec, stride, x, m0, m1, n0, n_out, y, bias, tiles);
  }
}

}  // namespace
