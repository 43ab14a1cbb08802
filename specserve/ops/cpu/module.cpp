// The Python module of specserve's CPU kernels (built by ops/cpu/build.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x @ (s*q)^T + bias, int8 blocks of 32 in tiled records");
  m.def("q4_linear", &q4_linear, "x @ (s*q+low)^T + bias, 4-bit blocks of 32 in tiled records");
  m.def("q5_linear", &q5_linear, "x @ (s*q+low)^T + bias, 5-bit blocks of 32 in tiled records");
  m.def("cached_attention", &cached_attention,
        "attention of q [T, H, D] over the slot KV cache, every row alone (causal, window)");
  m.def("attend_qkv", &attend_qkv,
        "rotary q/k from a fused qkv projection, k/v into the cache, then cached_attention");
  m.def("rms_norm", &rms_norm, "x / rms(x) * w over the last dim, float32");
  m.def("add_rms_norm", &add_rms_norm, "(x + y, rms_norm(x + y) * w), float32");
  m.def("gated", &gated, "act(gate) * up from gate_up [..., 2I]; act silu or tanh-gelu");
  m.def("rotary", &rotary, "NeoX rotary embedding of x [T, H, D] with cos/sin [T, D], float32");
}
