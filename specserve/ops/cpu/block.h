// A dense decoder block as one C++ call (block.cpp); module.cpp exposes it to Python.
#pragma once

#include <torch/extension.h>

#include <vector>

// One lowbit_linear call: its matrices' records, kinds and output counts, and the bias.
struct LinearCall {
  std::vector<torch::Tensor> records;
  std::vector<int64_t> kinds, n_outs;
  c10::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x) const;
};

struct DenseBlock {
  torch::Tensor attn_norm, ffn_norm;
  c10::optional<torch::Tensor> post_attn_norm, post_ffn_norm;  // Gemma's sandwich norms
  double eps;
  LinearCall qkv, o, gate_up, down;
  int64_t heads;
  double scale;
  int64_t window;
  c10::optional<torch::Tensor> q_norm, k_norm;  // Gemma's and Qwen3's per-head norms
  double qk_eps;
  bool silu;  // SwiGLU; tanh-GeGLU otherwise

  DenseBlock(torch::Tensor attn_norm, torch::Tensor ffn_norm,
             c10::optional<torch::Tensor> post_attn_norm,
             c10::optional<torch::Tensor> post_ffn_norm, double eps, LinearCall qkv,
             LinearCall o, LinearCall gate_up, LinearCall down, int64_t heads, double scale,
             int64_t window, c10::optional<torch::Tensor> q_norm,
             c10::optional<torch::Tensor> k_norm, double qk_eps, bool silu);

  std::vector<torch::Tensor> forward(torch::Tensor x, c10::optional<torch::Tensor> h,
                                     torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor cos, torch::Tensor sin,
                                     const std::vector<int64_t>& slots,
                                     const std::vector<int64_t>& starts,
                                     const std::vector<int64_t>& cu,
                                     torch::Tensor positions) const;

  std::vector<torch::Tensor> forward_normed(torch::Tensor x, torch::Tensor normed,
                                            torch::Tensor k_cache, torch::Tensor v_cache,
                                            torch::Tensor cos, torch::Tensor sin,
                                            const std::vector<int64_t>& slots,
                                            const std::vector<int64_t>& starts,
                                            const std::vector<int64_t>& cu,
                                            torch::Tensor positions) const;

  std::vector<torch::Tensor> eagle_step(torch::Tensor embeds, torch::Tensor g,
                                        torch::Tensor hidden_norm, torch::Tensor out_norm,
                                        bool norm_before_residual, torch::Tensor k_cache,
                                        torch::Tensor v_cache, torch::Tensor cos,
                                        torch::Tensor sin, const std::vector<int64_t>& slots,
                                        const std::vector<int64_t>& starts,
                                        const std::vector<int64_t>& cu,
                                        torch::Tensor positions) const;
};
