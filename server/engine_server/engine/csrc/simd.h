// Helpers shared by the engine's CPU kernels: dtype dispatch, and SIMD (AVX-512 when the build machine has it,
// else AVX2 with FMA and F16C).
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define ENGINE_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// CPUs with AVX2 but not AVX-512 (AMD before Zen 4, Intel client cores, many cloud VMs): 8 float lanes
#include <immintrin.h>
#define ENGINE_AVX2 1
#endif

// The dtypes a model runs in (float32, bfloat16, float16), with scalar_t bound in the body as AT_DISPATCH_*
// does; any other dtype (float64) is refused with ATen's "not implemented for" error.
#define ENGINE_DISPATCH_MODEL_DTYPES(TYPE, NAME, ...)                                        \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)                  \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__)           \
                                         AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__))

namespace engine_kernels {

// exp(y) of the SIMD paths (exp16, exp8): y = n ln2 + r with |r| <= ln2 / 2, exp(y) = 2^n * p(r), p the degree-6
// Taylor polynomial (relative error ~1e-7); y is clamped to [-88, 88] (the float range). One table for both ISAs,
// so their results cannot drift apart.
namespace exp_poly {
constexpr float kMaxInput = 88.f;
constexpr float kLog2e = 1.44269504f;
constexpr float kLn2Hi = 0.693145751953125f;  // ln 2 in two parts: n * kLn2Hi is exact for |n| <= 128
constexpr float kLn2Lo = 1.428606765330187e-06f;
constexpr int kNumCoeffs = 7;
constexpr float kCoeffs[kNumCoeffs] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // x^6 .. x^0
}  // namespace exp_poly

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

// exp(y) (exp_poly); scalef applies 2^n without overflow tricks
inline __m512 exp16(__m512 y) {
  using namespace exp_poly;
  y = _mm512_min_ps(_mm512_max_ps(y, _mm512_set1_ps(-kMaxInput)), _mm512_set1_ps(kMaxInput));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(y, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Hi), y);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Lo), r);
  __m512 p = _mm512_set1_ps(kCoeffs[0]);
  for (int i = 1; i < kNumCoeffs; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kCoeffs[i]));
  return _mm512_scalef_ps(p, n);
}
#endif  // ENGINE_AVX512

#ifdef ENGINE_AVX2
// 8 lanes of float from T; `left` < 8: only that many are read (a row's tail), the other lanes are 0
inline __m256 load8(const float* p, int64_t left) {
  if (left >= 8) return _mm256_loadu_ps(p);
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  return _mm256_maskload_ps(p, m);
}
// 16-bit rows: 8 values as 128 bits; a tail goes through a zeroed copy (AVX2 has no 16-bit masked load)
template <typename T>
inline __m128i load8_bits(const T* p, int64_t left) {
  if (left >= 8) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  alignas(16) uint16_t tmp[8] = {};
  std::memcpy(tmp, p, static_cast<size_t>(left) * sizeof(uint16_t));
  return _mm_load_si128(reinterpret_cast<const __m128i*>(tmp));
}
inline __m256 load8(const c10::BFloat16* p, int64_t left) {  // bfloat16 = the top half of a float32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load8_bits(p, left)), 16));
}
inline __m256 load8(const c10::Half* p, int64_t left) { return _mm256_cvtph_ps(load8_bits(p, left)); }

// lane i = the sum of the 8 lanes of v[i] (three rounds of pairwise adds, then the 128-bit halves)
inline __m256 sum8(const __m256 v[8]) {
  const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // a = [sums of v0..v3 over lanes 0-3 | over lanes 4-7], b likewise for v4..v7
  return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

// 8 lanes of float to T, rounded to nearest even as torch's own conversions round; `left` < 8: only that many
// are written (a row's tail)
inline void store8(float* p, __m256 v, int64_t left) {
  if (left >= 8) return _mm256_storeu_ps(p, v);
  const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_maskstore_ps(p, m, v);
}
template <typename T>
inline void store8_bits(T* p, __m128i bits, int64_t left) {
  if (left >= 8) return _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bits);
  alignas(16) uint16_t tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), bits);
  std::memcpy(p, tmp, static_cast<size_t>(left) * sizeof(uint16_t));
}
inline __m128i bf16_bits8(__m256 v) {  // as store16's bfloat16 rounding (NaN stays a quiet NaN)
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb)), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // every lane is below 2^16: packing with unsigned saturation keeps it as it is
  return _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
}
inline __m128i half_bits8(__m256 v) { return _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store8(c10::BFloat16* p, __m256 v, int64_t left) { store8_bits(p, bf16_bits8(v), left); }
inline void store8(c10::Half* p, __m256 v, int64_t left) { store8_bits(p, half_bits8(v), left); }

// the value T would hold: round to T and back (what torch does between two ops of a T model)
template <typename T>
inline __m256 round_as8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bf16_bits8(v)), 16));
  } else {
    return _mm256_cvtph_ps(half_bits8(v));
  }
}

inline float reduce_add8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

inline float reduce_max8(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// exp(y) (exp_poly), as exp16 computes it; 2^n is built in the exponent bits: n is within [-127, 127] after
// the clamp, and n = -127 (biased exponent 0) gives 0, exp's value to float precision there.
inline __m256 exp8(__m256 y) {
  using namespace exp_poly;
  y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-kMaxInput)), _mm256_set1_ps(kMaxInput));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(y, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Hi), y);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kCoeffs[0]);
  for (int i = 1; i < kNumCoeffs; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kCoeffs[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif  // ENGINE_AVX2

}  // namespace engine_kernels
