// One decoder block of a dense transformer (models/llama.py Block) in one call from Python,
// for float32 on CPU with low-bit weights: norm, fused q/k/v, attend_qkv, o, norm, fused
// gate/up, gated, down, each by the same kernel the module path calls, in the same order,
// so the bits are the same.
//
// Why: the module path makes ~15 Python calls per block (module __call__s, attribute
// lookups, argument checks) around its 8 kernels, and over a model's layers they add up to a
// sizeable share of a decode step. Here a block is one call (figures: docs/perf/kernels.md).

#include "block.h"

#include "kernels.h"

torch::Tensor LinearCall::operator()(const torch::Tensor& x) const {
  return lowbit_linear(x, records, kinds, n_outs, bias, c10::nullopt);
}

DenseBlock::DenseBlock(torch::Tensor attn_norm, torch::Tensor ffn_norm,
                       c10::optional<torch::Tensor> post_attn_norm,
                       c10::optional<torch::Tensor> post_ffn_norm, double eps, LinearCall qkv,
                       LinearCall o, LinearCall gate_up, LinearCall down, int64_t heads,
                       double scale, int64_t window, c10::optional<torch::Tensor> q_norm,
                       c10::optional<torch::Tensor> k_norm, double qk_eps, bool silu)
    : attn_norm(std::move(attn_norm)),
      ffn_norm(std::move(ffn_norm)),
      post_attn_norm(std::move(post_attn_norm)),
      post_ffn_norm(std::move(post_ffn_norm)),
      eps(eps),
      qkv(std::move(qkv)),
      o(std::move(o)),
      gate_up(std::move(gate_up)),
      down(std::move(down)),
      heads(heads),
      scale(scale),
      window(window),
      q_norm(std::move(q_norm)),
      k_norm(std::move(k_norm)),
      qk_eps(qk_eps),
      silu(silu) {}

// (x + h, this block's output): as Block.forward, the residual add of the block's output is
// left to the next block's first norm (h: the previous block's output; none in the first)
std::vector<torch::Tensor> DenseBlock::forward(torch::Tensor x, c10::optional<torch::Tensor> h,
                                               torch::Tensor k_cache, torch::Tensor v_cache,
                                               torch::Tensor cos, torch::Tensor sin,
                                               const std::vector<int64_t>& slots,
                                               const std::vector<int64_t>& starts,
                                               const std::vector<int64_t>& cu,
                                               torch::Tensor positions) const {
  torch::Tensor normed;
  if (h) {
    auto sum_norm = add_rms_norm(x, *h, attn_norm, eps);
    x = sum_norm[0], normed = sum_norm[1];
  } else {
    normed = rms_norm(x, attn_norm, eps);
  }
  return forward_normed(x, normed, k_cache, v_cache, cos, sin, slots, starts, cu, positions);
}

// The block past its first norm: `normed` is what q/k/v read, `x` the residual the attention's
// output is added to. An EAGLE-3 head's layer comes in here, its q/k/v reading two normed
// states side by side (models/eagle3.py).
std::vector<torch::Tensor> DenseBlock::forward_normed(
    torch::Tensor x, torch::Tensor normed, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor cos, torch::Tensor sin, const std::vector<int64_t>& slots,
    const std::vector<int64_t>& starts, const std::vector<int64_t>& cu,
    torch::Tensor positions) const {
  const auto att = attend_qkv(qkv(normed), k_cache, v_cache, cos, sin, slots, starts, cu,
                              positions, heads, scale, window, q_norm, k_norm, qk_eps);
  auto a = o(att.reshape({x.size(0), -1}));
  if (post_attn_norm) a = rms_norm(a, *post_attn_norm, eps);
  auto sum_norm = add_rms_norm(x, a, ffn_norm, eps);
  auto m = down(gated(gate_up(sum_norm[1]), silu));
  if (post_ffn_norm) m = rms_norm(m, *post_ffn_norm, eps);
  return {sum_norm[0], m};
}

// An EAGLE-3 head's cached step (models/eagle3.py `forward`) in one call: q/k/v read the
// token's embedding and the fused state, normed apart (attn_norm is the head's embedding
// norm) and side by side; the attention's output goes onto the fused state (its norm where
// the head norms before the residual); the layer's output comes back with its final norm,
// as [normed, prenorm]. The module path's kernels in its order, so its bits: a draft step is
// one row, and the Python between those kernels cost it a sixth of its layer.
std::vector<torch::Tensor> DenseBlock::eagle_step(
    torch::Tensor embeds, torch::Tensor g, torch::Tensor hidden_norm, torch::Tensor out_norm,
    bool norm_before_residual, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cos,
    torch::Tensor sin, const std::vector<int64_t>& slots, const std::vector<int64_t>& starts,
    const std::vector<int64_t>& cu, torch::Tensor positions) const {
  const auto normed_g = rms_norm(g, hidden_norm, eps);
  const auto x = torch::cat({rms_norm(embeds, attn_norm, eps), normed_g}, -1);
  const auto out = forward_normed(norm_before_residual ? normed_g : g, x, k_cache, v_cache, cos,
                                  sin, slots, starts, cu, positions);
  const auto last = add_rms_norm(out[0], out[1], out_norm, eps);
  return {last[1], last[0]};
}
