// Weight-only low-bit linears on x86 CPUs (the block dots: lowbit_avx2.cpp with AVX2,
// lowbit_vnni.cpp with AVX-512 VNNI): y[M, N] = x[M, K] @ W^T (+ bias), float32 in
// and out, weights kept in blocks of 32 inputs, scales as float16 (as GGUF stores them):
//   q8: W = s * q,        q int8,  one scale per block (GGUF Q8_0's own layout)
//   q4: W = s * q + low,  q 0..15, one scale and low per block
//   q5: W = s * (q - 16), q 0..31, one scale per block (GGUF Q5_0's own layout)
//   q6: W = d * sc * (q - 32), q 0..63, an int8 sc per 16 inputs (GGUF Q6_K's own values)
//   q4k: W = d * sc * q - dmin * m, q 0..15, 6-bit sc and m per block, d and dmin per 256
//       inputs (GGUF Q4_K's own values)
//   q6k: q6 with d per 256 inputs (GGUF Q6_K's own layout)
//
// Why a kernel of our own: one decode step reads every weight once, so its time is weight
// bytes / memory bandwidth. torch's float32 path reads 4 bytes per weight; its int8/int4 CPU
// kernels want bf16 activations, which AVX2 has no instructions for, and are compute-bound
// here. These read 1.0625 (q8), 0.6875 (q5) or 0.625 (q4) bytes per weight, GGUF's own
// figures for Q8_0 and Q5_0. (float32 scales would cost 0.125-0.25 bytes per weight more;
// figures: docs/perf/lowbit.md.)
//
// As llama.cpp does on CPUs, each row of x is first quantized to int8 in blocks of 32 (one
// scale per block, round to nearest), and a block's dot products run on integers: maddubs
// multiplies 32 unsigned by 32 signed bytes and adds pairs, madd adds pairs again.
//
// Memory layout (written by ops/fast/lowbit.py; ops/naive/lowbit.py reads it back plainly and
// computes what this file does, bit for bit): outputs in tiles of 8, one record per
// tile and block, stored [tile][block][record] so that a thread walking its tiles reads one
// sequential stream (at full bandwidth with a prefetch ahead):
//   q8: half s[8]; w + 128 as uint8 [8 steps][8 outputs][4]               272 bytes
//   q4: half s[8]; half low[8]; uint8 w[4][8][4]: step 2i in the low nibbles of
//       array i, step 2i+1 in its high nibbles                            160 bytes
//   q5: half s[8]; q4's nibble arrays; uint8 fifth[32]: bit j of byte i is step j's
//       byte i                                                            176 bytes
//   q6: half d[8]; int8 sc[2][8] (steps 0-3, 4-7); q4's nibble arrays for the low
//       4 bits; uint8 top[2][32]: bits 2j, 2j+1 of top[h]'s byte i are the top 2 bits
//       of step 4h+j's byte i                                             224 bytes
//   q4k: one record per 8 outputs x 256 inputs (8 blocks): half d[8], dmin[8]; uint8
//       sc[8 blocks][8], m[8 blocks][8]; each block's q4 nibble arrays   1184 bytes
//   q6k: one record per 8 outputs x 256 inputs: half d[8]; each block's q6 record
//       less its d                                                       1680 bytes
// A step is 4 consecutive inputs of each of the 8 outputs: one 256-bit vector whose 32-bit
// lane o is output o. Multiplied by x's 4 bytes broadcast to every lane, maddubs + madd
// leave output o's 4-input dot in lane o, so the 8 outputs' block dots add up vertically in
// one vector and meet their scales as one float32 lane each (8 float16 scales are one
// vcvtph2ps); no horizontal sums. The weight vector is loaded (and for q4/q5 unpacked) once
// per step and serves every row of x in the tile, so each extra row (verification, prefill,
// other slots) costs about three instructions per step: broadcast, multiply, add. (The
// previous layout, 4 outputs per record with a 32-input block per output, spent a transpose
// per row and block.)
// q4/q5 products are summed in 16 bits over a block and widened once: q4's 16 products per
// lane fit (|q x| <= 15 * 127), q5's fit once its -16 is applied (x's precomputed sums times
// 16 taken off the 16-bit sums), so it needs no field and no second multiply.
//
// Batch invariance by construction: y[m, n] is one vector lane that always runs the same
// sequence of operations (row m quantized alone; blocks in order; exact integer block dots;
// acc = fma(dot, s * d, acc), then for q4 acc = fma(low, d * sum(q_x), acc); the same final
// add), whatever M is and whichever group of rows the row lands in. The same holds across
// instruction sets: the VNNI dots are the same integers, and lowbit_tile.h's float steps are
// shared.

#include <ATen/Parallel.h>
#include <omp.h>
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels.h"
#include "lowbit_tile.h"

namespace {

// x quantized per row in blocks of 32: x ~ d * q; `isum` = sum(q), for VNNI q5's and q8's
// offsets, and `sum` = d * sum(q), for q4's low term; `pairs`, AVX2 q6's and q5's (x_offsets).
// Buffers are per calling thread and reused, so a call allocates nothing but y.
struct QuantRows {
  std::vector<int8_t> q;
  std::vector<float> d, sum;
  std::vector<int32_t> isum, pairs, halves;
  int64_t nblocks = 0, rows = 0;
  XRows view() const {
    return XRows{q.data(),     d.data(),      sum.data(), isum.data(),
                 pairs.data(), halves.data(), nblocks,    rows};
  }
};

// The offsets for one block of q, from its 32 values as four int32 vectors (inputs 0-7, 8-15,
// 16-23, 24-31). AVX2's `pairs` hold int16 pairs: the sums of the inputs each 16-bit lane of a
// step's maddubs meets (even lanes: inputs 4s, 4s+1; odd: 4s+2, 4s+3) as two int16 in one
// int32, for q6 per half h (16 inputs, steps 4h..4h+3) times 32, for q5 over the block times 16
// (entry 2); VNNI's `halves`: -32 times each half's sum, where its chain starts. The q6 and q5
// dots multiply unsigned q (0..63, 0..31) and take these off, which is the product with q - 32
// (q - 16): |32 * sum| <= 32 * 8 * 127 and |16 * sum| <= 16 * 16 * 127 fit 16 bits. Returns
// sum(q).
int32_t x_offsets(const __m256i* q, int32_t* pairs, int32_t* halves) {
  auto pack = [](int lo, int hi) {  // two int16 (which hold them) in one int32
    return static_cast<int32_t>(static_cast<uint16_t>(lo) | (static_cast<uint32_t>(hi) << 16));
  };
  int even_all = 0, odd_all = 0;
  for (int h = 0; h < 2; ++h) {
    // lane j: inputs j and j + 8 of the half, then lanes j and j + 4 added: j % 4 is what a
    // lane's input is modulo 4, which decides its maddubs lane
    const __m256i s = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
    const __m128i f = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    const int even = _mm_extract_epi32(f, 0) + _mm_extract_epi32(f, 1);
    const int odd = _mm_extract_epi32(f, 2) + _mm_extract_epi32(f, 3);
    pairs[h] = pack(32 * even, 32 * odd);
    halves[h] = -32 * (even + odd);
    even_all += even, odd_all += odd;
  }
  pairs[2] = pack(16 * even_all, 16 * odd_all);
  return even_all + odd_all;
}

// max|v| over one block of 32 inputs
float block_amax(const float* v) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i)
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(v + 8 * i)));
  m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0x4E));
  m = _mm256_max_ps(m, _mm256_shuffle_ps(m, m, 0xB1));
  return _mm256_cvtss_f32(m);
}

// One block of 32 inputs with scale amax / 127 (amax: the block's max|v|, or its super-block's):
// q = round-to-nearest-even(v * 127 / amax) (as llama.cpp's Q8_0 and Q8_K), into q, with the
// block's sums. AVX2, because the scalar loop (nearbyint per input) was a visible share of an
// 8-row forward (figures: docs/perf/lowbit.md).
void quantize_block(const float* v, float amax, int8_t* q, float& d, float& sum, int32_t& isum,
                    int32_t* pairs, int32_t* halves) {
  const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
  __m256i qi[4];
  for (int i = 0; i < 4; ++i)  // the default rounding mode: to nearest, ties to even
    qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(v + 8 * i), _mm256_set1_ps(id)));
  // packs interleave the 128-bit halves; the permute puts the 32 bytes back in order
  const __m256i b = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), b);
  isum = x_offsets(qi, pairs, halves);
  d = amax / 127.0f;
  sum = d * static_cast<float>(isum);
}

// The calling thread's buffers, sized for x [M, K] (reused: a call allocates nothing but y).
QuantRows& rows_for(int64_t M, int64_t K) {
  thread_local QuantRows r;
  const int64_t nb = K / BLOCK;
  r.q.resize(M * K), r.d.resize(M * nb), r.sum.resize(M * nb), r.isum.resize(M * nb);
  r.pairs.resize(lowbit::PAIRS * M * nb), r.halves.resize(2 * M * nb);
  r.nblocks = nb, r.rows = M;
  return r;
}

// Groups i0 .. i1 - 1 of x [M, K], `per` blocks a group (1, or 8: a super-block of 256), in
// x's order (row m's group g is i = m * K / (32 per) + g), quantized into r, block-major
// (XRows), each group with one scale: per block of 32 for the block kinds, per 256 for q4k and
// q6k (as llama.cpp's Q8_K), whose walks then sum a super-block's block dots as integers
void quantize_range(const float* x, QuantRows& r, int64_t i0, int64_t i1, int per) {
  const int64_t M = r.rows, groups = r.nblocks / per;
  // row m's group g, counted on from i0 (a division per block was measurably slower;
  // figures: docs/perf/lowbit.md)
  int64_t m = i0 / groups, g = i0 % groups;
  for (int64_t i = i0; i < i1; ++i) {
    const float* v = x + i * per * BLOCK;
    float amax = 0.0f;
    for (int j = 0; j < per; ++j) amax = std::max(amax, block_amax(v + j * BLOCK));
    for (int j = 0; j < per; ++j) {
      const int64_t o = (g * per + j) * M + m;  // block-major
      quantize_block(v + j * BLOCK, amax, r.q.data() + o * BLOCK, r.d[o], r.sum[o], r.isum[o],
                     r.pairs.data() + lowbit::PAIRS * o, r.halves.data() + 2 * o);
    }
    if (++g == groups) g = 0, ++m;
  }
}

// The instruction set the kernels run on: AVX-512 VNNI where the CPU has it, unless
// SPECSERVE_CPU_ISA=avx2 (or lowbit_isa("avx2")) asks for AVX2. Both give the same bits.
enum Isa { AVX2 = 0, VNNI = 1 };

bool cpu_has_vnni() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

Isa default_isa() {
  const char* want = std::getenv("SPECSERVE_CPU_ISA");
  if (want && std::string(want) == "avx2") return AVX2;
  return cpu_has_vnni() ? VNNI : AVX2;
}

std::atomic<int>& isa() {
  static std::atomic<int> value{default_isa()};
  return value;
}

// VNNI calls of this many rows or more take two tiles per 512-bit vector (lowbit_vnni.cpp):
// twice the multiplies per instruction, for the rows of verification and prefill. Where fewer
// rows run one tile per 256-bit vector depends on the CPU: on a Zen 4 or 5 one stream of
// records reads faster there, on an Intel Xeon two do even at one row, so a model's loading
// times both and sets this (models/layers/lowbit_pairs.py; figures: docs/perf/lowbit.md).
std::atomic<int64_t>& pair_rows() {
  static std::atomic<int64_t> value{4};
  return value;
}
// x rows in chunks of about this many bytes, so that a chunk stays in L2 while a thread
// walks its tiles (a tile's records are read once per chunk)
constexpr int64_t CHUNK_BYTES = 256 * 1024;

// One weight matrix of a call: its kind (0 q8, 1 q4, 2 q5, 3 q6, 4 q4k, 5 q6k), records and
// outputs. A call may run several that read the same x (q/k/v, gate/up) side by side, of
// different kinds: x is quantized once and all their tiles share one parallel region.
struct Part {
  int64_t kind;
  const uint8_t* base;
  int64_t tiles, tile_bytes, n0;  // n0: its first output column in y
};

constexpr int64_t KINDS = 6;
using lowbit::Q4KLayout, lowbit::Q4Layout, lowbit::Q5Layout, lowbit::Q6Layout, lowbit::Q8Layout;
using Q6KLayout = lowbit::Q6K<Q6Layout>;
constexpr int64_t RECORD_BYTES[KINDS] = {Q8Layout::RECORD, Q4Layout::RECORD,  Q5Layout::RECORD,
                                         Q6Layout::RECORD, Q4KLayout::RECORD, Q6KLayout::RECORD};
// inputs one record covers: a block of 32, or q4k's and q6k's super-block of 256
constexpr int64_t RECORD_INPUTS[KINDS] = {Q8Layout::INPUTS, Q4Layout::INPUTS,  Q5Layout::INPUTS,
                                          Q6Layout::INPUTS, Q4KLayout::INPUTS, Q6KLayout::INPUTS};

// Tiles t and, where `tiles` is 2, t + 1 of part p (AVX2 runs one at a time)
void tile_rows(bool vnni, const Part& p, int64_t t, int tiles, const XRows& x, int64_t m0,
               int64_t m1, int64_t n_out, float* y, const float* bias) {
  const uint8_t* rec = p.base + t * p.tile_bytes;
  const int64_t n0 = p.n0 + t * TILE;
  if (vnni)  // two tiles on 512-bit vectors, one on 256-bit (the next tile's records follow)
    return lowbit::vnni_tile_rows(p.kind, rec, p.tile_bytes, tiles, x, m0, m1, n0, n_out, y, bias);
  lowbit::avx2_tile_rows(p.kind, rec, x, m0, m1, n0, n_out, y, bias);
}

// Tiles t0 .. t1 - 1 of the call's matrices (`first`: each part's first tile) for every row
// of x, in row chunks, each weight read from memory once per chunk
void walk(bool vnni, const std::vector<Part>& parts, const std::vector<int64_t>& first,
          const XRows& x, int64_t t0, int64_t t1, int64_t n_out, float* yp, const float* bias) {
  const int64_t M = x.rows, K = x.nblocks * BLOCK;
  const int64_t group = vnni ? lowbit::VNNI_ROWS : lowbit::AVX2_ROWS;
  const bool pairs = vnni && M >= pair_rows().load();
  const int64_t chunk = std::max<int64_t>(group, CHUNK_BYTES / K / group * group);
  for (int64_t mc = 0; mc < M; mc += chunk) {
    const int64_t me = std::min(M, mc + chunk);
    size_t p = std::upper_bound(first.begin(), first.end(), t0) - first.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= first[p + 1]) ++p;
      // VNNI's 512-bit vectors take two tiles of the same part at once
      const int tiles = pairs && t + 1 < t1 && t + 1 < first[p + 1] ? 2 : 1;
      tile_rows(vnni, parts[p], t - first[p], tiles, x, mc, me, n_out, yp, bias);
      t += tiles - 1;
    }
  }
}

// The blocks of 32 that share one scale of x in a call: 8 (a super-block of 256) where every
// part is q4k or q6k, 1 where none is. Those two kinds' walks sum a super-block's block dots as
// integers under one float step, which needs x's scale constant over the super-block; the block
// kinds' records take a scale per block and x's with it. A call cannot mix the two
// (fuse_lowbit fuses only layers of one X_GROUP).
int per_group(const std::vector<Part>& parts) {
  auto super = [](const Part& p) { return RECORD_INPUTS[p.kind] > BLOCK; };
  const bool all = std::all_of(parts.begin(), parts.end(), super);
  TORCH_CHECK(all || std::none_of(parts.begin(), parts.end(), super),
              "lowbit linear: q4k and q6k (x scaled per 256 inputs) cannot share a call with "
              "q8, q4, q5 or q6 (per 32)");
  return all ? 8 : 1;
}

// x's blocks quantized per thread of the region from this many up (fewer: by the first
// thread alone, while the others wait at the barrier)
constexpr int64_t SPLIT_BLOCKS = 64;

// y = x @ [W_0; W_1; ...]^T + bias for a whole call, in one parallel region: each thread
// quantizes its share of x's blocks, then (after a barrier) walks its share of the tiles.
// (x's quantization was a region of its own, or serial below 256 blocks: 8 rows of a
// 896-input projection, 224 blocks, ran on one thread while the other spun.) Tiles are split
// as at::parallel_for splits them, into contiguous runs, so each thread reads one stream.
void run(const torch::Tensor& x_in, const std::vector<Part>& parts, int64_t n_out, float* yp,
         const float* bias) {
  const int64_t M = x_in.size(0), K = x_in.size(1);
  const bool vnni = isa().load() == VNNI;
  QuantRows& rows = rows_for(M, K);
  const XRows x = rows.view();
  std::vector<int64_t> first{0};  // global tile index -> part: parts' tile ranges
  for (const Part& p : parts) first.push_back(first.back() + p.tiles);
  const int per = per_group(parts);
  const int64_t tiles = first.back(), blocks = M * x.nblocks, groups = blocks / per;
  // about 64K weights per thread at least: small matrices stay on one thread
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (K * TILE));
  const int64_t want = std::min<int64_t>(at::get_num_threads(), (tiles + grain - 1) / grain);
  const float* xp = x_in.data_ptr<float>();
  auto share = [&](int64_t tid, int64_t team) {
    const int64_t quantizers = blocks >= SPLIT_BLOCKS ? team : 1;
    if (tid < quantizers)
      quantize_range(xp, rows, groups * tid / quantizers, groups * (tid + 1) / quantizers, per);
    if (team > 1) {
#pragma omp barrier
    }
    const int64_t per = (tiles + team - 1) / team, t0 = tid * per;
    if (t0 < tiles) walk(vnni, parts, first, x, t0, std::min(tiles, t0 + per), n_out, yp, bias);
  };
  if (want <= 1 || omp_in_parallel()) return share(0, 1);
#pragma omp parallel num_threads(want)
  share(omp_get_thread_num(), omp_get_num_threads());
}

void check_args(const torch::Tensor& x, int64_t n_out, const c10::optional<torch::Tensor>& bias,
                const c10::optional<torch::Tensor>& out) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "lowbit linear: x must be a 2-D float32 CPU tensor");
  TORCH_CHECK(x.size(1) % BLOCK == 0, "lowbit linear: in_features must be a multiple of 32");
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
}

// Part i's records checked against x and its output count; every part but the last must
// fill whole tiles (a padded tile would write into the next part's columns).
Part make_part(const torch::Tensor& records, int64_t kind, int64_t n, int64_t n0, bool last,
               int64_t K) {
  TORCH_CHECK(kind >= 0 && kind < KINDS,
              "lowbit linear: kind must be 0 (q8), 1 (q4), 2 (q5), 3 (q6), 4 (q4k), 5 (q6k)");
  const int64_t bytes = RECORD_BYTES[kind], inputs = RECORD_INPUTS[kind];
  TORCH_CHECK(records.scalar_type() == torch::kUInt8 && records.is_contiguous() &&
                  records.dim() == 3 && records.size(0) * TILE >= n &&
                  records.size(0) * TILE < n + TILE && records.size(1) * inputs == K &&
                  records.size(2) == bytes,
              "lowbit linear: records must be uint8 [ceil(N/8), K/", inputs, ", ", bytes, "]");
  TORCH_CHECK(last || n % TILE == 0, "lowbit linear: only the last part may end mid-tile");
  return Part{kind, records.data_ptr<uint8_t>(), records.size(0), records.size(1) * bytes, n0};
}

}  // namespace

torch::Tensor lowbit_linear(torch::Tensor x, const std::vector<torch::Tensor>& records,
                            const std::vector<int64_t>& kinds, const std::vector<int64_t>& n_outs,
                            const c10::optional<torch::Tensor>& bias,
                            const c10::optional<torch::Tensor>& out) {
  x = x.contiguous();
  TORCH_CHECK(!records.empty() && kinds.size() == records.size() &&
                  n_outs.size() == records.size(),
              "lowbit linear: one kind and output count per records tensor");
  int64_t n_out = 0;
  std::vector<Part> parts;
  for (size_t i = 0; i < records.size(); ++i) {
    const bool last = i + 1 == records.size();
    parts.push_back(make_part(records[i], kinds[i], n_outs[i], n_out, last, x.size(1)));
    n_out += n_outs[i];
  }
  check_args(x, n_out, bias, out);
  auto y = out ? *out : torch::empty({x.size(0), n_out}, x.options());
  if (x.size(0) > 0) run(x, parts, n_out, y.data_ptr<float>(), bias ? bias->data_ptr<float>() : nullptr);
  return y;
}

std::string lowbit_isa(const std::string& want) {
  if (want == "avx2") {
    isa().store(AVX2);
  } else if (want == "avx512vnni" || want == "auto") {
    const bool ok = cpu_has_vnni();
    TORCH_CHECK(ok || want == "auto", "lowbit_isa: this CPU has no AVX-512 VNNI");
    isa().store(ok ? VNNI : AVX2);
  } else {
    TORCH_CHECK(want.empty(), "lowbit_isa: want '', 'auto', 'avx2' or 'avx512vnni', got '",
                want, "'");
  }
  return isa().load() == VNNI ? "avx512vnni" : "avx2";
}

bool lowbit_wide() { return isa().load() == VNNI; }

int64_t lowbit_pair_rows(int64_t rows) {
  TORCH_CHECK(rows >= 0, "lowbit_pair_rows: rows must be >= 0 (0: only ask)");
  if (rows > 0) pair_rows().store(rows);
  return pair_rows().load();
}
