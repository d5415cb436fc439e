// int4 group-wise weights widened to bf16 in zmm registers (the avx512_bf16
// build only): linear_w4_bf16's decode path and tiles, and dequantize_w4's
// bf16 output there.
#pragma once
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "int4_widen.h"

namespace kiln_int4 {

// int4 group weights (linear_f32.cpp's Int4Problem layout) widened to bf16 in
// zmm registers, 32 weights at a time, by table lookup: a group's 16 possible
// weights are computed once (q * scale + min by FMA in fp32, as widen_row,
// rounded to nearest even by vcvtne2ps2bf16) and every code picks its own
// with one vpermw. That equals widen_row<uint16_t>'s rounding (torch's
// .to(bfloat16)) for every value but fp32 denormals, which the convert reads
// as zero: a widened weight is never one with fp16 parameters, and vdpbf16ps
// reads a bf16 denormal as zero either way. The lookup costs three shuffles
// per 32 weights where converting each code cost nine instructions (shift,
// mask, int->float, FMA per 16, one rounding per 32), which held the one-row
// kernel at ~11 G weights/s per core on Zen 4 (16 with the lookup).
struct Int4ToBf16 {
  // A run of 64 weights is eight 32-bit words, weight 8s + j in nibble s of
  // word j (int4_widen.h), so weight 32h + e of the run (half h, e < 32) is
  // nibble e / 8 of the 16-bit unit 2 (e % 8) + h: `gather[h]` picks that
  // unit into lane e and `shift` moves its nibble to bits 0-3.
  __m512i gather[2], shift;
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  Int4ToBf16() {
    alignas(64) uint16_t unit[2][32], bits[32];
    for (int e = 0; e < 32; ++e) {
      for (int h = 0; h < 2; ++h) unit[h][e] = static_cast<uint16_t>(2 * (e % 8) + h);
      bits[e] = static_cast<uint16_t>(4 * (e / 8));
    }
    for (int h = 0; h < 2; ++h) gather[h] = _mm512_load_si512(unit[h]);
    shift = _mm512_load_si512(bits);
  }

  // The run's eight words (32 bytes of codes) in the low half of a zmm.
  static __m512i words(const uint8_t* run) {
    return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run)));
  }

  // A group's 16 weights in bf16, in lanes 0-15 and again in 16-31 (vpermw
  // reads five index bits; the fifth is the next nibble's, which the copy
  // makes moot). `params` holds (scale, min) in lanes 2i and 2i + 1.
  __m512i table(__m512 params, int i) const {
    const __m512 w = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), params),
                                     _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i + 1), params));
    return (__m512i)_mm512_cvtne2ps_pbh(w, w);
  }

  // The tables of a run's two halves (`split`: the second half starts the
  // next group), the parameters read and converted as one vector.
  template <typename P>
  void half_tables(const P* p, bool split, __m512i t[2]) const {
    __m128 v;
    if constexpr (std::is_same_v<P, float>) {
      v = split ? _mm_loadu_ps(p) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
    } else {
      int32_t pair;  // one group's two fp16
      std::memcpy(&pair, p, sizeof(pair));
      v = _mm_cvtph_ps(split ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)) : _mm_cvtsi32_si128(pair));
    }
    const __m512 params = _mm512_castps128_ps512(v);
    t[0] = t[1] = table(params, 0);
    if (split) t[1] = table(params, 1);
  }

  __m512bh half(__m512i words, int h, __m512i table) const {
    const __m512i codes = _mm512_srlv_epi16(_mm512_permutexvar_epi16(gather[h], words), shift);
    return (__m512bh)_mm512_permutexvar_epi16(codes, table);
  }

  // One weight row of K into out (bf16 bits), for run_w4_bf16's tiles.
  template <typename P>
  void row(const uint8_t* codes, const P* params, uint16_t* out, int64_t K, int64_t G) const {
    for (int64_t b = 0; b < K; b += 64) {
      __m512i t[2];
      half_tables(params + (b / G) * 2, b / G != (b + 32) / G, t);
      const __m512i w = words(codes + b / 2);
      for (int h = 0; h < 2; ++h) _mm512_storeu_si512(out + b + 32 * h, (__m512i)half(w, h, t[h]));
    }
  }
};

}  // namespace kiln_int4
