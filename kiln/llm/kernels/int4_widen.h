// One row of int4 group-wise weights (linear_f32.cpp's Int4Problem layout)
// widened to fp32 in memory: w = fma(q, scale, min) lane by lane, the very
// operation the int4 kernel applies in registers, so the widened row is the
// one the kernel multiplies by. Used by dequantize_w4 (a whole weight, for
// oneDNN at prefill sizes) and by linear_w4 above the narrow sizes (a tile of
// rows at a time, reused by every x row).
#pragma once
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <type_traits>

namespace kiln_int4 {

// (scale, min) of group g of a row as floats.
template <typename P>
inline void group_params(const P* p, float& scale, float& min) {
  if constexpr (std::is_same_v<P, float>) {
    scale = p[0], min = p[1];
  } else {
    scale = static_cast<float>(c10::Half(p[0], c10::Half::from_bits()));
    min = static_cast<float>(c10::Half(p[1], c10::Half::from_bits()));
  }
}

// Runs of 64 weights as eight 32-bit words, word j holding weight 8s + j of
// the run in bits 4s .. 4s+3, so nibble s of all eight words is weights
// 8s .. 8s+7: one shift, one mask, one convert, one FMA, one store.
template <typename P>
inline void widen_row(const uint8_t* codes, const P* params, float* out, int64_t K, int64_t G) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  for (int64_t b = 0; b < K; b += 64) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b / 2));
    for (int s = 0; s < 8; ++s) {
      float scale, min;
      group_params(params + ((b + 8 * s) / G) * 2, scale, min);
      const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(words, _mm256_set1_epi32(4 * s)), low4);
      const __m256 w = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(scale), _mm256_set1_ps(min));
      _mm256_storeu_ps(out + b + 8 * s, w);
    }
  }
}

}  // namespace kiln_int4
