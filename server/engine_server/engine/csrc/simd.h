// Helpers shared by the engine's CPU kernels: dtype dispatch, and SIMD (AVX-512 when the build machine has it).
#pragma once

#include <ATen/Dispatch.h>
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ENGINE_AVX512 1
#endif

// The dtypes a model runs in (float32, bfloat16, float16), with scalar_t bound in the body as AT_DISPATCH_*
// does; any other dtype (float64) is refused with ATen's "not implemented for" error.
#define ENGINE_DISPATCH_MODEL_DTYPES(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                  \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)           \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace engine_kernels {

#ifdef ENGINE_AVX512
// 16 lanes of float from T (masked: lanes past the row read nothing)
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {  // bfloat16 = the top half of a float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p)); }

// 16 lanes of float to T, rounded to nearest even as torch's own conversions round
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(rounded));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// the value T would hold: round to T and back (what torch does between two ops of a T model)
template <typename T>
inline __m512 round_as(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) T tmp[16];
    store16(tmp, v, 0xFFFF);
    return load16(tmp, 0xFFFF);
  }
}

inline __mmask16 lanes(int64_t left) { return left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1); }

// lane i = the sum of the 16 lanes of v[i]: a transpose-and-add tree, ~3 instructions per sum instead of
// the ~10 of one horizontal reduction each
inline __m512 sum16(const __m512 v[16]) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit block: 2-lane partials of v[2i], v[2i+1]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit block: the block's sums of v[4i..4i+3]
    const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(pairs[2 * i]), _mm512_castps_pd(pairs[2 * i + 1]));
    const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(pairs[2 * i]), _mm512_castps_pd(pairs[2 * i + 1]));
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  }
  for (int i = 0; i < 2; ++i)  // blocks (0+1, 2+3) of quads[2i], then of quads[2i+1]
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

// exp(y): 2^n * p(r), y = n ln2 + r, |r| <= ln2 / 2, p the degree-6 Taylor polynomial (relative error
// ~1e-7); scalef applies 2^n without overflow tricks. y is clamped to [-88, 88] (the float range).
inline __m512 exp16(__m512 y) {
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-88.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), y);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}
#endif  // ENGINE_AVX512

}  // namespace engine_kernels
