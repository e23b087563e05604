// Python bindings of the engine's CPU kernels (one extension module, built by engine/cpu_kernels.py).
// NOTE: the header that makes at::Tensor a pybind11 argument type (what <torch/python.h> and
// <torch/extension.h> include for it); the whole of either takes 2-3x as long to compile.
#include <torch/csrc/utils/pybind.h>

#include "ops.h"
#include "simd.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &engine_kernels::paged_decode_attention,
        "decode attention over a paged KV cache (CPU)");
  m.def("paged_prefill_attention", &engine_kernels::paged_prefill_attention,
        "causal attention of prefill chunks over a paged KV cache (CPU)");
  m.def("rms_norm", &engine_kernels::rms_norm, "Llama-style RMSNorm over the last dim (CPU)");
  m.def("silu_and_mul", &engine_kernels::silu_and_mul, "T(silu(gate)) * up (CPU)");
  m.def("silu_and_mul_rows", &engine_kernels::silu_and_mul_rows,
        "T(silu(gate)) * up over rows of [gate | up] (CPU)");
  m.def("rotary_embedding", &engine_kernels::rotary_embedding,
        "q * cos + rotate_half(q) * sin for q and k, as transformers' apply_rotary_pos_emb (CPU)");
  m.def("apply_token_bitmask", &engine_kernels::apply_token_bitmask,
        "logits of the given rows set to -inf where the packed token bitmask is clear (CPU)");
  m.def("isa", [] {
#if defined(ENGINE_AVX512)
    return "avx512";
#elif defined(ENGINE_AVX2)
    return "avx2";
#else
    return "portable";
#endif
  }, "which implementation this build compiled: avx512, avx2 or portable");
}
