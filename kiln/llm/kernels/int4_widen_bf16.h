// int4 group-wise weights widened to bf16 in zmm registers (the avx512_bf16
// build only): linear_w4_bf16's decode path and tiles, and dequantize_w4's
// bf16 output there.
#pragma once
#include <immintrin.h>

#include <cstdint>

#include "int4_widen.h"

namespace kiln_int4 {

// int4 group weights (linear_f32.cpp's Int4Problem layout) widened to bf16 in
// zmm registers, 32 weights at a time: the int4 kernel's FMA (q * scale + min
// in fp32, as widen_row), then rounded to nearest even by vcvtne2ps2bf16.
// That equals widen_row<uint16_t>'s rounding (torch's .to(bfloat16)) for
// every value but fp32 denormals, which the convert reads as zero: a widened
// weight is never one with fp16 parameters, and vdpbf16ps reads a bf16
// denormal as zero either way.
struct Int4ToBf16 {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  // Half h of a run (weights b + 32h .. b + 32h + 31): lanes 0-7 of the run's
  // eight words (in both 256-bit halves) shifted to nibble 4h + 2j and lanes
  // 8-15 to nibble 4h + 2j + 1 give weights b + 32h + 16j .. b + 32h + 16j + 15.
  __m512i shift[2][2];

  Int4ToBf16() {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 2; ++j)
        shift[h][j] = _mm512_add_epi32(_mm512_set1_epi32(16 * h + 8 * j), _mm512_maskz_set1_epi32(0xFF00, 4));
  }

  // The run's eight words (32 bytes of codes) in both halves of a zmm.
  static __m512i words(const uint8_t* run) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run)));
  }

  // (scale, min) of the groups of a run's two halves (`split`: the second
  // half starts the next group), each broadcast to 16 lanes.
  template <typename P>
  static void half_params(const P* p, bool split, __m512 scale[2], __m512 min[2]) {
    float sc, mn;
    kiln_int4::group_params(p, sc, mn);
    scale[0] = scale[1] = _mm512_set1_ps(sc), min[0] = min[1] = _mm512_set1_ps(mn);
    if (split) {
      kiln_int4::group_params(p + 2, sc, mn);
      scale[1] = _mm512_set1_ps(sc), min[1] = _mm512_set1_ps(mn);
    }
  }

  __m512bh half(__m512i words, int h, __m512 scale, __m512 min) const {
    __m512 f[2];
    for (int j = 0; j < 2; ++j)
      f[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(words, shift[h][j]), low4)), scale,
                             min);
    return _mm512_cvtne2ps_pbh(f[1], f[0]);  // lanes 0-15 from f[0]
  }

  // One weight row of K into out (bf16 bits), for run_w4_bf16's tiles.
  template <typename P>
  void row(const uint8_t* codes, const P* params, uint16_t* out, int64_t K, int64_t G) const {
    for (int64_t b = 0; b < K; b += 64) {
      const bool split = b / G != (b + 32) / G;
      __m512 scale[2], min[2];
      half_params(params + (b / G) * 2, split, scale, min);
      const __m512i w = words(codes + b / 2);
      for (int h = 0; h < 2; ++h) _mm512_storeu_si512(out + b + 32 * h, (__m512i)half(w, h, scale[h], min[h]));
    }
  }
};

}  // namespace kiln_int4
