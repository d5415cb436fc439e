// AVX-512 helpers shared by the avx512_bf16 build's kernels.
#pragma once
#include <immintrin.h>

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

}  // namespace kiln_simd512
