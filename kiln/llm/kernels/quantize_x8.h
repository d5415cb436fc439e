// Dynamic int8 quantization of fp32 activations in groups of 32 (AVX2),
// shared by the kernels that multiply int8 activations (linear_w4a8.cpp,
// linear_q8_0a8.cpp): per group sx = max|x| / 127 (1 for a zero group),
// xq = round(x / sx), half to even, so |xq| <= 127. A group's codes depend
// only on its 32 values: a row quantizes alike in any batch.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace kiln_x8 {

constexpr int64_t kGroup = 32;  // x values per scale

struct Group {
  float scale, sum;  // sx, and sx * sum(xq): the sum of x as quantized
};

// One group of 32 x values -> round(x / sx) into q[0..32) (natural order), sx and sx * sum(xq).
inline Group quantize_group(const float* x, int32_t* q) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, amax);
  float m = 0.0f;
  for (float a : lanes) m = std::max(m, a);
  // |x * inv| <= 127 (up to rounding of inv, never to 127.5): the codes fit int8.
  const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
  for (int i = 0; i < 4; ++i)  // cvtps rounds to nearest even (MXCSR default), as torch.round
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
  int32_t qsum = 0;
  for (int i = 0; i < 32; ++i) qsum += q[i];
  const float sx = m > 0.0f ? m / 127.0f : 1.0f;
  return {sx, sx * static_cast<float>(qsum)};
}

}  // namespace kiln_x8
