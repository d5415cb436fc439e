// AVX-512 helpers shared by the avx512_bf16 build's kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <span>
#include <type_traits>

#include "simd.h"

namespace kiln_simd512 {

// Sum of 16 lanes as a fixed tree: lane i + lane i+8, then i + i+4, i + i+2,
// i + i+1 (results are reproducible, whatever kernel shape calls it).
// (Summing 16 accumulators at once by a transposed tree of the same pairs
// measured no faster in the bf16 linear kernel.)
inline float reduce16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// Sixteen-lane twins of simd.h's helpers: the same operations lane for lane
// (the same polynomial, the same integer rounding), so a value comes out
// bit-identical whichever width computed it.

// kiln_simd::exp_nonpositive (its constants, its order of operations).
inline __m512 exp_nonpositive(__m512 x) {
  using namespace kiln_simd::exp_poly;
  x = _mm512_max_ps(x, _mm512_set1_ps(kLowest));
  const __m512 fx = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Lo), _mm512_fnmadd_ps(fx, _mm512_set1_ps(kLn2Hi), x));
  __m512 y = _mm512_set1_ps(kHorner[0]);
  for (const float c : std::span(kHorner).subspan(1)) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i n = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(n));
}

// kiln_simd::bf16_round_bits: nearest even, NaN as 0x7fc0 (c10's rounding).
inline __m512i bf16_round_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  const __m512i kept = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), kept, _mm512_set1_epi32(0x7fc00000));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_round_bits(v), 16));  // each fits 16 bits
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bits);
}

// kiln_simd::round_as: v as after a store to T and a load back.
template <typename T>
inline __m512 round_as(__m512 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm512_castsi512_ps(bf16_round_bits(v));
}

}  // namespace kiln_simd512
