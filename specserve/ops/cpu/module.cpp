// The Python module of specserve's CPU kernels (built by ops/cpu/build.py).
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lowbit_linear", &lowbit_linear,
        "x @ [W_0; W_1; ...]^T + bias, each W in tiled records of kind 0 q8, 1 q4, 2 q5");
  m.def("lowbit_isa", &lowbit_isa,
        "the low-bit kernels' instruction set ('avx2' or 'avx512vnni'); an argument sets it "
        "('auto': the best this CPU has; '': only ask). Both give the same bits.");
  m.def("cached_attention", &cached_attention,
        "attention of q [T, H, D] over the slot KV cache, every row alone (causal, window)");
  m.def("attend_qkv", &attend_qkv,
        "(q/k norm,) rotary q/k from a fused qkv projection, k/v into the cache, then "
        "cached_attention");
  m.def("rms_norm", &rms_norm, "x / rms(x) * w over the last dim, float32");
  m.def("add_rms_norm", &add_rms_norm, "(x + y, rms_norm(x + y) * w), float32");
  m.def("gated", &gated, "act(gate) * up from gate_up [..., 2I]; act silu or tanh-gelu");
  m.def("rotary", &rotary, "NeoX rotary embedding of x [T, H, D] with cos/sin [T, D], float32");
}
