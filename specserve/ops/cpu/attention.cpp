// Attention of new query rows over the slot KV cache, float32 on CPU: decode (1 row a
// slot), verification (k draft rows) and prefill chunks.
//
// Why a kernel of our own: torch's SDPA on CPU takes its generic "math" path for a few
// query rows (matmul, masked softmax, matmul, with a mask tensor and several temporaries
// per layer), a sizeable share of a decode step. Here the keys a task reads are transposed
// once per chunk and serve every query head and row of the task (attention_tile.h), on
// 512-bit vectors where the CPU has AVX-512 (attention_avx512.cpp). The previous kernel, one
// dot product per (row, head, key) with a horizontal sum on 256-bit vectors, was slower,
// most of all for many rows (figures: docs/perf/kernels.md).
//
// Every (row, query head) is computed from its own causal (and sliding-window) range of the
// cache, with one fixed order of operations, so a row's result does not depend on the other
// rows of the batch: the same batch invariance as the per-row Python path.

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "attention_tile.h"
#include "kernels.h"

namespace {

// rows [T, Hkv, D] (each row's Hkv * D floats contiguous) into cache [slots, max_len, Hkv, D]:
// slot i's rows cu[i] .. cu[i+1] at positions starts[i] ... One memcpy a row: per slot, the
// torch ops this took (select, narrow, copy_ for keys and for values) cost a visible share
// of a step in dispatch (figures: docs/perf/kernels.md).
void store_rows(const torch::Tensor& rows, torch::Tensor& cache, const std::vector<int64_t>& slots,
                const std::vector<int64_t>& starts, const std::vector<int64_t>& cu) {
  const int64_t max_len = cache.size(1), width = cache.size(2) * cache.size(3);
  TORCH_CHECK(cache.scalar_type() == torch::kFloat32 && cache.is_contiguous(),
              "attend_qkv: caches must be contiguous float32 [slots, max_len, Hkv, D]");
  TORCH_CHECK(rows.scalar_type() == torch::kFloat32 && rows.size(1) * rows.size(2) == width &&
                  rows.stride(2) == 1 && rows.stride(1) == rows.size(2),
              "attend_qkv: key and value rows must be float32 [T, Hkv, D], each row contiguous");
  const float* src = rows.data_ptr<float>();
  float* dst = cache.data_ptr<float>();
  for (size_t i = 0; i < slots.size(); ++i) {
    const int64_t n = cu[i + 1] - cu[i];
    TORCH_CHECK(slots[i] >= 0 && slots[i] < cache.size(0) && starts[i] >= 0 &&
                    starts[i] + n <= max_len,
                "attend_qkv: rows beyond the cache");
    for (int64_t r = 0; r < n; ++r)
      std::memcpy(dst + (slots[i] * max_len + starts[i] + r) * width,
                  src + (cu[i] + r) * rows.stride(0), width * sizeof(float));
  }
}


// Tasks: per slot and kv head, the slot's rows in blocks of at most MAX_ROWS (their scratch
// stays small; 8 rows x 7 heads are 56 vectors per transposed chunk for the 0.5B's
// verification), and in more blocks where there are fewer (slot, kv head) pairs than threads.
// (Splitting a group's heads instead, for one decode row of one kv head, gained nothing: each
// task transposes the same keys, and for a few heads that is most of the work.)
constexpr int64_t MAX_ROWS = 8;

// A slot's alternatives (rows stored past their position, batch.py `branches`) come last
// and get a task each: their own key is read from elsewhere, which no other row shares.
std::vector<AttnTask> make_tasks(const std::vector<int64_t>& slots,
                                 const std::vector<int64_t>& starts,
                                 const std::vector<int64_t>& cu, const int64_t* pos,
                                 int64_t heads, int64_t kv_heads, int64_t threads) {
  std::vector<AttnTask> tasks;
  const int64_t group = heads / kv_heads;
  const int64_t pairs = static_cast<int64_t>(slots.size()) * kv_heads;
  for (size_t i = 0; i < slots.size(); ++i) {
    int64_t n = cu[i + 1] - cu[i];
    while (n > 0 && pos[cu[i] + n - 1] != starts[i] + n - 1) --n;
    const int64_t blocks =
        std::min(n, std::max((n + MAX_ROWS - 1) / MAX_ROWS, (threads + pairs - 1) / pairs));
    for (int64_t g = 0; g < kv_heads; ++g) {
      for (int64_t b = 0; b < blocks; ++b)
        tasks.push_back({slots[i], g, cu[i] + n * b / blocks, cu[i] + n * (b + 1) / blocks,
                         g * group, (g + 1) * group});
      for (int64_t r = cu[i] + n; r < cu[i + 1]; ++r)
        tasks.push_back({slots[i], g, r, r + 1, g * group, (g + 1) * group, pos[r],
                         starts[i] + r - cu[i]});
    }
  }
  return tasks;
}

// Each thread takes a run of tasks of about equal work (keys seen, summed over vectors): a
// prefill chunk's late rows see many more keys than its early ones.
void run_tasks(const AttnArgs& a, const std::vector<AttnTask>& tasks, int64_t threads) {
  std::vector<int64_t> end(tasks.size());  // cumulative work up to and with task i
  int64_t total = 0;
  for (size_t i = 0; i < tasks.size(); ++i) {
    const AttnTask& t = tasks[i];
    for (int64_t r = t.r0; r < t.r1; ++r) total += (a.hi[r] - a.lo[r] + 1) * (t.h1 - t.h0);
    end[i] = total;
  }
  const bool wide = lowbit_wide();
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> p, kt(a.D * ATTN_CH);
    for (size_t i = 0; i < tasks.size(); ++i) {
      const int64_t mid = end[i] - (end[i] - (i ? end[i - 1] : 0)) / 2;
      const int64_t owner = std::min(threads - 1, mid * threads / std::max<int64_t>(total, 1));
      if (owner < t0 || owner >= t1) continue;
      const AttnTask& t = tasks[i];
      p.resize((t.r1 - t.r0) * (t.h1 - t.h0) * attn_span(a, t).width);
      if (wide)
        attend_task_avx512(a, t, p.data(), kt.data());
      else
        attend_task<F8>(a, t, p.data(), kt.data());
    }
  });
}

}  // namespace

torch::Tensor cached_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               const std::vector<int64_t>& slots,
                               const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
                               torch::Tensor positions, double scale, int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(),
              "attention: q must be contiguous float32 [T, H, D]");
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && k_cache.dim() == 4 &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == torch::kFloat32 && v_cache.is_contiguous(),
              "attention: caches must be contiguous float32 [slots, max_len, Hkv, D]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(D % 64 == 0 && k_cache.size(3) == D && H % Hkv == 0,
              "attention: head_dim must be a multiple of 64 and heads a multiple of kv heads");
  TORCH_CHECK(cu.size() == slots.size() + 1 && starts.size() == slots.size() && cu.back() == T &&
                  positions.numel() == T && positions.scalar_type() == torch::kInt64,
              "attention: slots, starts, cu_seqlens and positions do not describe q's rows");
  std::vector<int64_t> lo(T), hi(T);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (size_t i = 0; i < slots.size(); ++i)
    for (int64_t r = cu[i]; r < cu[i + 1]; ++r) {
      // a row sees the keys up to its position; an alternative's own key is stored later
      const int64_t at = starts[i] + r - cu[i];
      TORCH_CHECK(pos[r] >= 0 && pos[r] <= at && at < k_cache.size(1),
                  "attention: position beyond the cache, or past where its row is stored");
      hi[r] = pos[r], lo[r] = window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0;
    }
  for (int64_t s : slots)
    TORCH_CHECK(s >= 0 && s < k_cache.size(0), "attention: slot beyond the cache");
  auto out = torch::empty_like(q);
  const AttnArgs a{q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                   v_cache.data_ptr<float>(), k_cache.size(1), Hkv, H, D, lo.data(), hi.data(),
                   static_cast<float>(scale)};
  const int64_t threads = at::get_num_threads();
  run_tasks(a, make_tasks(slots, starts, cu, pos, H, Hkv, threads), threads);
  return out;
}

// A layer's whole attention from its fused q/k/v projection [T, (H + 2 Hkv) D]: norm q and k
// per head where the model has q/k norms (Gemma 3, Qwen3), rotate them, store k and v at their
// positions in this layer's cache, attend. One call from Python for what took ~15 small ops
// there (slices, views, two norms, two rotaries, the cache writes per slot); the same kernels
// as those ops, so the same bits.
torch::Tensor attend_qkv(torch::Tensor qkv, torch::Tensor k_cache, torch::Tensor v_cache,
                         torch::Tensor cos, torch::Tensor sin, const std::vector<int64_t>& slots,
                         const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
                         torch::Tensor positions, int64_t heads, double scale, int64_t window,
                         const c10::optional<torch::Tensor>& q_norm,
                         const c10::optional<torch::Tensor>& k_norm, double eps) {
  TORCH_CHECK(k_cache.dim() == 4, "attention: caches must be [slots, max_len, Hkv, D]");
  const int64_t T = qkv.size(0), Hkv = k_cache.size(2), D = k_cache.size(3);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * Hkv) * D,
              "attend_qkv: qkv must be [T, (heads + 2 kv heads) * head_dim]");
  TORCH_CHECK(starts.size() == slots.size() && cu.size() == slots.size() + 1 && cu.back() == T,
              "attend_qkv: slots, starts and cu_seqlens do not describe qkv's rows");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "attend_qkv: q and k norms go together");
  auto q = qkv.narrow(1, 0, heads * D).view({T, heads, D});
  auto k = qkv.narrow(1, heads * D, Hkv * D).view({T, Hkv, D});
  if (q_norm) q = rms_norm(q, *q_norm, eps), k = rms_norm(k, *k_norm, eps);
  q = rotary(q, cos, sin), k = rotary(k, cos, sin);
  auto v = qkv.narrow(1, (heads + Hkv) * D, Hkv * D).view({T, Hkv, D});
  store_rows(k, k_cache, slots, starts, cu);
  store_rows(v, v_cache, slots, starts, cu);
  return cached_attention(q, k_cache, v_cache, slots, starts, cu, positions, scale, window);
}
