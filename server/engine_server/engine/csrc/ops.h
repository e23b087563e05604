// The engine's CPU kernels, as bound to Python in bindings.cpp (engine/cpu_kernels.py loads them).
#pragma once

// NOTE: ATen's Tensor alone, not <torch/extension.h> (the C++ frontend and pybind11): the kernels compile in
// ~9 s instead of ~45 s each on a 2-vCPU machine; only bindings.cpp needs the Python side.
#include <ATen/core/Tensor.h>

namespace engine_kernels {

// Decode attention over the paged KV cache, read in place (paged_decode_attention.cpp).
void paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                            int64_t window, double softcap, at::Tensor& out);

// Prefill attention over the paged KV cache, read in place: the causal rows of whole chunks
// (paged_prefill_attention.cpp).
void paged_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                             const at::Tensor& block_tables, const at::Tensor& starts, const at::Tensor& num_rows,
                             double scale, int64_t window, double softcap, at::Tensor& out);

// out = weight * T(x * rsqrt(mean(x^2) + eps)) over the last dim, as Llama-style RMSNorm computes it
// (float32 statistics, the normalized value rounded to the model dtype before the weight) (fused_ops.cpp).
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out);

// out = T(silu(gate)) * up, the gated MLP's activation (fused_ops.cpp).
void silu_and_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out);

// The same over rows of [gate | up] (the gate and up projections computed as one GEMM): out [..., n] from
// gate_up [..., 2n], both contiguous (fused_ops.cpp).
void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out);

// q_out = q * cos + rotate_half(q) * sin, k_out likewise: transformers' apply_rotary_pos_emb (each product
// rounded to the model dtype, then the sum) in one pass (fused_ops.cpp). q, k, q_out, k_out: [b, heads, t, d]
// with unit stride along d (any other strides); cos, sin: [b, t, d], unit stride along d.
void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& q_out, at::Tensor& k_out);

// logits[rows[j], t] = -inf for every token t whose bit (bitmask[j, t / 32] >> t % 32) & 1 is clear: the
// structured-output mask of some rows, in place (token_bitmask.cpp). logits: [batch, vocab] float32.
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);

}  // namespace engine_kernels
