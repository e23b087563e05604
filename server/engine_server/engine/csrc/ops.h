// The engine's CPU kernels, as bound to Python in bindings.cpp (engine/cpu_kernels.py loads them).
#pragma once

#include <torch/extension.h>

namespace engine_kernels {

// Decode attention over the paged KV cache, read in place (paged_decode_attention.cpp).
void paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_tables, const torch::Tensor& context_lens, double scale,
                            int64_t window, double softcap, torch::Tensor& out);

// out = weight * T(x * rsqrt(mean(x^2) + eps)) over the last dim, as Llama-style RMSNorm computes it
// (float32 statistics, the normalized value rounded to the model dtype before the weight) (fused_ops.cpp).
void rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps, torch::Tensor& out);

// out = T(silu(gate)) * up, the gated MLP's activation (fused_ops.cpp).
void silu_and_mul(const torch::Tensor& gate, const torch::Tensor& up, torch::Tensor& out);

}  // namespace engine_kernels
