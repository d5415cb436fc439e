// The fp32 vector a kernel computes on, by build: Lanes8 (AVX2 + FMA, every
// build) and Lanes16 (both AVX-512 builds; AVX-512F only). The same static
// interface, so a kernel is written once over `V` and compiled at the width
// its build has. Loads widen fp32, bf16 or fp16 exactly; stores round once to
// the destination's type; `sum` adds the lanes in one fixed order.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>

#include "simd.h"
#if KILN_AVX512 || KILN_AVX512_BF16
#define KILN_LANES16 1
#include "simd512.h"
#endif

namespace kiln_lanes {

struct Lanes8 {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static Vec load(const T* p) { return kiln_simd::load8(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  template <typename T>
  static void store(T* p, Vec v) { kiln_simd::store8f(p, v); }
  static float sum(Vec v) { return kiln_simd::hsum(v); }
};

#ifdef KILN_LANES16
struct Lanes16 {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Vec load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  template <typename T>
  static void store(T* p, Vec v) {  // 16-bit: each half rounded as store8f rounds
    kiln_simd::store8f(p, _mm512_castps512_ps256(v));
    kiln_simd::store8f(p + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  static float sum(Vec v) { return kiln_simd512::reduce16(v); }
};
#endif

}  // namespace kiln_lanes
