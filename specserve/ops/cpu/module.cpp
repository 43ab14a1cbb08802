// The Python module of specserve's CPU kernels (built by ops/cpu/build.py).
#include "block.h"
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lowbit_linear", &lowbit_linear,
        "x @ [W_0; W_1; ...]^T + bias, each W in tiled records of kind 0 q8, 1 q4, 2 q5");
  m.def("lowbit_isa", &lowbit_isa,
        "the low-bit kernels' instruction set ('avx2' or 'avx512vnni'); an argument sets it "
        "('auto': the best this CPU has; '': only ask). Both give the same bits.");
  m.def("lowbit_pair_rows", &lowbit_pair_rows,
        "VNNI calls of this many rows or more take two tiles per 512-bit vector; an argument "
        "sets it (0: only ask). Both give the same bits.");
  m.def("cached_attention", &cached_attention,
        "attention of q [T, H, D] over the slot KV cache, every row alone (causal, window; "
        "a row stored past its position sees the keys before it and its own)");
  m.def("attend_qkv", &attend_qkv,
        "(q/k norm,) rotary q/k from a fused qkv projection, k/v into the cache, then "
        "cached_attention");
  m.def("rms_norm", &rms_norm, "x / rms(x) * w over the last dim, float32");
  m.def("add_rms_norm", &add_rms_norm, "(x + y, rms_norm(x + y) * w), float32");
  m.def("gated", &gated, "act(gate) * up from gate_up [..., 2I]; act silu or tanh-gelu");
  m.def("rotary", &rotary, "NeoX rotary embedding of x [T, H, D] with cos/sin [T, D], float32");
  m.def("top_softmax", &top_softmax,
        "each row's k likeliest indices, likeliest first, and their softmax probabilities, "
        "float32 logits [N, V]");
  py::class_<LinearCall>(m, "LinearCall")
      .def(py::init([](std::vector<torch::Tensor> records, std::vector<int64_t> kinds,
                       std::vector<int64_t> n_outs, c10::optional<torch::Tensor> bias) {
             return LinearCall{std::move(records), std::move(kinds), std::move(n_outs),
                               std::move(bias)};
           }),
           "one lowbit_linear call: records, kinds, output counts, bias");
  py::class_<DenseBlock>(m, "DenseBlock")
      .def(py::init<torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, double, LinearCall, LinearCall, LinearCall,
                    LinearCall, int64_t, double, int64_t, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, double, bool>(),
           "attn_norm, ffn_norm, post_attn_norm, post_ffn_norm, eps, qkv, o, gate_up, down, "
           "heads, scale, window, q_norm, k_norm, qk_eps, silu")
      .def("forward", &DenseBlock::forward,
           "(x, h, k_cache, v_cache, cos, sin, slots, starts, cu, positions) -> "
           "[x + h, the block's output]")
      .def("eagle_step", &DenseBlock::eagle_step,
           "(embeds, g, hidden_norm, out_norm, norm_before_residual, k_cache, v_cache, cos, "
           "sin, slots, starts, cu, positions) -> [normed, prenorm]: an EAGLE-3 head's layer");
}
