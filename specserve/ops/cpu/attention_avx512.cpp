// cached attention's tasks on 512-bit vectors (attention_tile.h), for CPUs with AVX-512F:
// attention.cpp calls attend_task_avx512 where the kernels' instruction set is AVX-512
// (lowbit_wide). Twice the lanes of F8 per fma, and 32 registers: 8 query vectors (16
// accumulators) share each transposed key vector, and 4 heads of a row each value vector.
// The same fma chains per lane as F8, so the same bits.
//
// Compiled for AVX-512 whatever the CPU; no torch headers (see attention_tile.h).
#pragma GCC target("avx2,fma,f16c,avx512f")

#include "attention_tile.h"

namespace {

struct F16 {
  using T = __m512;
  static constexpr int W = 16;
  static constexpr int QK_NV = 8;
  static constexpr int AV_NV = 4;
  static ATTN_INLINE T load(const float* p) { return _mm512_loadu_ps(p); }
  static ATTN_INLINE void store(float* p, T a) { _mm512_storeu_ps(p, a); }
  static ATTN_INLINE T splat(float v) { return _mm512_set1_ps(v); }
  static ATTN_INLINE T zero() { return _mm512_setzero_ps(); }
  static ATTN_INLINE T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static ATTN_INLINE T mul(T a, T b) { return _mm512_mul_ps(a, b); }
};

}  // namespace

void attend_task_avx512(const AttnArgs& a, const AttnTask& t, float* p, float* kt) {
  attend_task<F16>(a, t, p, kt);
}
