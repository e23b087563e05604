// Fused elementwise ops of Llama-style decoder layers (CPU).
//
// Why: in a bfloat16 model torch runs RMSNorm as six ops (to float32, pow, mean, rsqrt, mul, to bf16,
// mul) and the MLP activation as two, each a pass over memory and a dispatch; on the 30M benchmark model
// they took ~30% of a 2048-token prefill step. Each kernel here is one pass that rounds where torch
// rounds (to the model dtype between ops), so the results are torch's to within float32 arithmetic order.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>

#include "ops.h"
#include "simd.h"

namespace engine_kernels {
namespace {

template <typename T>
inline float round_scalar(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 8, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* xr = x + r * hidden;
      T* yr = out + r * hidden;
#ifdef ENGINE_AVX512
      __m512 acc = _mm512_setzero_ps();
      for (int64_t e = 0; e < hidden; e += 16) {
        const __m512 v = load16(xr + e, lanes(hidden - e));
        acc = _mm512_fmadd_ps(v, v, acc);
      }
      const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(hidden) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      for (int64_t e = 0; e < hidden; e += 16) {
        const __mmask16 m = lanes(hidden - e);
        const __m512 normed = round_as<T>(_mm512_mul_ps(load16(xr + e, m), vinv));
        store16(yr + e, _mm512_mul_ps(load16(w + e, m), normed), m);
      }
#elif defined(ENGINE_AVX2)
      __m256 acc = _mm256_setzero_ps();
      for (int64_t e = 0; e < hidden; e += 8) {
        const __m256 v = load8(xr + e, hidden - e);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float inv = 1.f / std::sqrt(reduce_add8(acc) / static_cast<float>(hidden) + eps);
      const __m256 vinv = _mm256_set1_ps(inv);
      for (int64_t e = 0; e < hidden; e += 8) {
        const __m256 normed = round_as8<T>(_mm256_mul_ps(load8(xr + e, hidden - e), vinv));
        store8(yr + e, _mm256_mul_ps(load8(w + e, hidden - e), normed), hidden - e);
      }
#else
      float sum = 0.f;
      for (int64_t e = 0; e < hidden; ++e) sum += static_cast<float>(xr[e]) * static_cast<float>(xr[e]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
      for (int64_t e = 0; e < hidden; ++e)
        yr[e] = static_cast<T>(static_cast<float>(w[e]) * round_scalar<T>(static_cast<float>(xr[e]) * inv));
#endif
    }
  });
}

// out[i] = T(silu(gate[i])) * up[i] for i in [first, last).
template <typename T>
inline void silu_mul_span(const T* gate, const T* up, T* out, int64_t first, int64_t last) {
#ifdef ENGINE_AVX512
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = first; i < last; i += 16) {
    const __mmask16 m = lanes(last - i);
    const __m512 g = load16(gate + i, m);
    const __m512 act = round_as<T>(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
    store16(out + i, _mm512_mul_ps(act, load16(up + i, m)), m);
  }
#elif defined(ENGINE_AVX2)
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t i = first; i < last; i += 8) {
    const __m256 g = load8(gate + i, last - i);
    const __m256 act = round_as8<T>(_mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
    store8(out + i, _mm256_mul_ps(act, load8(up + i, last - i)), last - i);
  }
#else
  for (int64_t i = first; i < last; ++i) {
    const float g = static_cast<float>(gate[i]);
    out[i] = static_cast<T>(round_scalar<T>(g / (1.f + std::exp(-g))) * static_cast<float>(up[i]));
  }
#endif
}

template <typename T>
void silu_mul(const T* gate, const T* up, T* out, int64_t count) {
  at::parallel_for(0, count, 8192, [&](int64_t first, int64_t last) { silu_mul_span(gate, up, out, first, last); });
}

// Rows of [gate | up] (one GEMM's output, gate and up projections fused) -> rows of T(silu(gate)) * up.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t width) {
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const T* gate = gate_up + r * 2 * width;
      silu_mul_span(gate, gate + width, out + r * width, 0, width);
    }
  });
}

// One row: out = x * c + rotate_half(x) * s, rotate_half(x) = cat(-x2, x1) for the halves x1, x2 of x; each
// product rounded to T, then the sum (as torch computes it in a T model).
template <typename T>
inline void rotate_row(const T* x, const T* c, const T* s, T* out, int64_t half) {
#ifdef ENGINE_AVX512
  for (int64_t e = 0; e < half; e += 16) {
    const __mmask16 m = lanes(half - e);
    const __m512 x1 = load16(x + e, m), x2 = load16(x + half + e, m);
    const __m512 lo = _mm512_sub_ps(round_as<T>(_mm512_mul_ps(x1, load16(c + e, m))),
                                    round_as<T>(_mm512_mul_ps(x2, load16(s + e, m))));
    const __m512 hi = _mm512_add_ps(round_as<T>(_mm512_mul_ps(x2, load16(c + half + e, m))),
                                    round_as<T>(_mm512_mul_ps(x1, load16(s + half + e, m))));
    store16(out + e, lo, m);
    store16(out + half + e, hi, m);
  }
#elif defined(ENGINE_AVX2)
  for (int64_t e = 0; e < half; e += 8) {
    const int64_t left = half - e;
    const __m256 x1 = load8(x + e, left), x2 = load8(x + half + e, left);
    const __m256 lo = _mm256_sub_ps(round_as8<T>(_mm256_mul_ps(x1, load8(c + e, left))),
                                    round_as8<T>(_mm256_mul_ps(x2, load8(s + e, left))));
    const __m256 hi = _mm256_add_ps(round_as8<T>(_mm256_mul_ps(x2, load8(c + half + e, left))),
                                    round_as8<T>(_mm256_mul_ps(x1, load8(s + half + e, left))));
    store8(out + e, lo, left);
    store8(out + half + e, hi, left);
  }
#else
  for (int64_t e = 0; e < half; ++e) {
    const float x1 = static_cast<float>(x[e]), x2 = static_cast<float>(x[e + half]);
    out[e] = static_cast<T>(round_scalar<T>(x1 * static_cast<float>(c[e])) +
                            round_scalar<T>(-x2 * static_cast<float>(s[e])));
    out[e + half] = static_cast<T>(round_scalar<T>(x2 * static_cast<float>(c[e + half])) +
                                   round_scalar<T>(x1 * static_cast<float>(s[e + half])));
  }
#endif
}

// One [b, heads, t, d] tensor: each row (b, h, t) rotated with row (b, t) of cos and sin.
template <typename T>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t heads = x.size(1), len = x.size(2), half = x.size(3) / 2;
  // strides read once (Tensor::stride() is a call with a dim check, per row it cost more than the row)
  const int64_t xs0 = x.stride(0), xs1 = x.stride(1), xs2 = x.stride(2), cs0 = cos.stride(0), cs1 = cos.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1), os2 = out.stride(2);
  const T* xp = x.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* op = out.data_ptr<T>();
  at::parallel_for(0, x.size(0) * heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t bh = first; bh < last; ++bh) {
      const int64_t b = bh / heads, h = bh % heads;
      for (int64_t t = 0; t < len; ++t) {
        const T* xr = xp + b * xs0 + h * xs1 + t * xs2;
        const T* c = cp + b * cs0 + t * cs1;
        const T* s = sp + b * cs0 + t * cs1;  // sin has cos's strides (checked)
        T* o = op + b * os0 + h * os1 + t * os2;
        rotate_row(xr, c, s, o, half);
      }
    }
  });
}

void check_rotary_operand(const at::Tensor& x, const at::Tensor& out, const at::Tensor& cos) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "rotary_embedding: CPU tensors expected");
  TORCH_CHECK(x.dim() == 4 && out.sizes() == x.sizes() && x.stride(3) == 1 && out.stride(3) == 1,
              "rotary_embedding: [b, heads, t, d] tensors with unit stride along d expected");
  TORCH_CHECK(x.size(0) == cos.size(0) && x.size(2) == cos.size(1) && x.size(3) == cos.size(2) && x.size(3) % 2 == 0,
              "rotary_embedding: cos and sin must be [b, t, d] for [b, heads, t, d] inputs (d even)");
  TORCH_CHECK(x.scalar_type() == cos.scalar_type() && out.scalar_type() == cos.scalar_type(),
              "rotary_embedding: one dtype expected");
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* what) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.scalar_type() == b.scalar_type(), what,
              ": contiguous tensors of one dtype expected");
}

}  // namespace

void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  check_same(x, weight, "rms_norm");
  check_same(x, out, "rms_norm");
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.numel() == hidden && out.numel() == x.numel(), "rms_norm: shapes");
  ENGINE_DISPATCH_MODEL_DTYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            x.numel() / hidden, hidden, static_cast<float>(eps));
  });
}

void silu_and_mul(const at::Tensor& gate, const at::Tensor& up, at::Tensor& out) {
  check_same(gate, up, "silu_and_mul");
  check_same(gate, out, "silu_and_mul");
  TORCH_CHECK(gate.numel() == up.numel() && gate.numel() == out.numel(), "silu_and_mul: shapes");
  ENGINE_DISPATCH_MODEL_DTYPES(gate.scalar_type(), "silu_and_mul", [&] {
    silu_mul<scalar_t>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), gate.numel());
  });
}

void silu_and_mul_rows(const at::Tensor& gate_up, at::Tensor& out) {
  check_same(gate_up, out, "silu_and_mul_rows");
  const int64_t width = out.size(-1);
  TORCH_CHECK(gate_up.dim() == out.dim() && gate_up.size(-1) == 2 * width && gate_up.numel() == 2 * out.numel(),
              "silu_and_mul_rows: gate_up [..., 2 * n] and out [..., n] expected");
  ENGINE_DISPATCH_MODEL_DTYPES(gate_up.scalar_type(), "silu_and_mul_rows", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), out.numel() / std::max<int64_t>(1, width), width);
  });
}

void rotary_embedding(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& q_out, at::Tensor& k_out) {
  TORCH_CHECK(cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.stride(2) == 1 && sin.stride(2) == 1 &&
                  cos.strides() == sin.strides() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotary_embedding: cos and sin: [b, t, d] CPU tensors, unit stride along d");
  check_rotary_operand(q, q_out, cos);
  check_rotary_operand(k, k_out, cos);
  ENGINE_DISPATCH_MODEL_DTYPES(q.scalar_type(), "rotary_embedding", [&] {
    rotate_rows<scalar_t>(q, cos, sin, q_out);
    rotate_rows<scalar_t>(k, cos, sin, k_out);
  });
}

}  // namespace engine_kernels
