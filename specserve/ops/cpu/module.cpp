// The Python module of specserve's CPU kernels (built by ops/cpu/build.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("q8_linear", &q8_linear, "x @ (s*q)^T + bias, int8 blocks of 32 in tiled records");
  m.def("q4_linear", &q4_linear, "x @ (s*q+low)^T + bias, 4-bit blocks of 32 in tiled records");
  m.def("q5_linear", &q5_linear, "x @ (s*q+low)^T + bias, 5-bit blocks of 32 in tiled records");
  m.def("cached_attention", &cached_attention,
        "attention of q [T, H, D] over the slot KV cache, every row alone (causal, window)");
  m.def("rms_norm", &rms_norm, "x / rms(x) * w over the last dim, float32");
  m.def("rotary", &rotary, "NeoX rotary embedding of x [T, H, D] with cos/sin [T, D], float32");
}
