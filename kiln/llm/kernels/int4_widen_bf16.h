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
// zmm registers, 64 weights (one run) at a time, by table lookup: a run's 16
// or 32 possible weights (one or two groups) are computed once (q * scale +
// min by FMA in fp32, as widen_row, rounded to nearest even by
// vcvtne2ps2bf16) and every code picks its own with one vpermw. That equals
// widen_row<uint16_t>'s rounding (torch's .to(bfloat16)) for every value but
// fp32 denormals, which the convert reads as zero: a widened weight is never
// one with fp16 parameters, and vdpbf16ps reads a bf16 denormal as zero
// either way.
//
// The codes are taken in the order they lie in, not the weights' order: the
// run's 32 bytes are zero-extended to 32 16-bit lanes, and lane l's low
// nibble indexes the first 32-lane half, its high nibble the second. A run
// of 64 weights is eight 32-bit words, weight 8s + j in nibble s of word j
// (int4_widen.h), so byte 4j + b holds weights 16b + j (low) and 16b + 8 + j
// (high): half 0, lane l = 4j + b is weight 16b + j; half 1 is weight
// 16b + 8 + j. That is run_order_weight below; the kernels take x in that order too
// (to_run_order, once per call), so every dot product pairs the same x and w
// as in the natural order, in a fixed summation order of its own. Lanes with
// b >= 2 hold weights 32-63, the run's second group where a group boundary
// falls mid-run: their index gets bit 4, which picks the table's upper 16
// entries. Per run: one zero-extension, three bitwise ops and the two lookups,
// where gathering each half's codes into the natural order took one vpermw and
// one variable shift per 32 weights besides the lookup (120 one-row
// projections of SmolLM2's shapes, 1 thread, Zen 4, min of 40: 7.4-8.0 ms -> 6.6-7.0).
struct Int4ToBf16 {
  __m512i second_group, order[2], natural[2];
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);

  // run_order_weight(l): the weight (natural index within the run) at run-order position l < 64.
  static constexpr int run_order_weight(int l) { return 16 * (l % 32 % 4) + 8 * (l / 32) + l % 32 / 4; }

  Int4ToBf16() {
    alignas(64) uint16_t group[32], fwd[64], inv[64];
    for (int l = 0; l < 64; ++l) {
      fwd[l] = static_cast<uint16_t>(run_order_weight(l));
      inv[run_order_weight(l)] = static_cast<uint16_t>(l);
    }
    for (int l = 0; l < 32; ++l) group[l] = static_cast<uint16_t>(l % 4 >= 2 ? 16 : 0);
    second_group = _mm512_load_si512(group);
    for (int h = 0; h < 2; ++h) {
      order[h] = _mm512_load_si512(fwd + 32 * h);
      natural[h] = _mm512_load_si512(inv + 32 * h);
    }
  }

  // The run's two groups' weights in bf16: the first in lanes 0-15, the
  // second (the first again unless `split`) in 16-31. `p` holds (scale, min)
  // of the first group, then of the second.
  template <typename P>
  __m512i table(const P* p, bool split) const {
    __m128 v;
    if constexpr (std::is_same_v<P, float>) {
      v = split ? _mm_loadu_ps(p) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
    } else {
      int32_t pair;  // one group's two fp16
      std::memcpy(&pair, p, sizeof(pair));
      v = _mm_cvtph_ps(split ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)) : _mm_cvtsi32_si128(pair));
    }
    const __m512 params = _mm512_castps128_ps512(v);
    const auto group = [&](int i) {
      return _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i), params),
                             _mm512_permutexvar_ps(_mm512_set1_epi32(2 * i + 1), params));
    };
    const __m512 first = group(0);
    return (__m512i)_mm512_cvtne2ps_pbh(split ? group(1) : first, first);
  }

  // A run's 64 weights as bf16 in run order: 32 in out[0], 32 in out[1].
  void widen(const uint8_t* run, __m512i table, __m512bh out[2]) const {
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run)));
    const __m512i low = _mm512_ternarylogic_epi32(bytes, _mm512_set1_epi16(0x0F), second_group, 0xEA);  // (a & b) | c
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), second_group);
    out[0] = (__m512bh)_mm512_permutexvar_epi16(low, table);
    out[1] = (__m512bh)_mm512_permutexvar_epi16(high, table);
  }

  // K values (bf16 bits, K a multiple of 64) from natural order into run order.
  void to_run_order(const uint16_t* in, uint16_t* out, int64_t K) const {
    for (int64_t b = 0; b < K; b += 64) {
      const __m512i lo = _mm512_loadu_si512(in + b), hi = _mm512_loadu_si512(in + b + 32);
      for (int h = 0; h < 2; ++h) _mm512_storeu_si512(out + b + 32 * h, _mm512_permutex2var_epi16(lo, order[h], hi));
    }
  }

  // One weight row of K widened into out (bf16 bits): in run order for
  // run_w4_bf16's tiles (against x in run order), in natural order for dequantize_w4.
  template <typename P>
  void run_order_row(const uint8_t* codes, const P* params, uint16_t* out, int64_t K, int64_t G) const {
    row<false>(codes, params, out, K, G);
  }
  template <typename P>
  void natural_row(const uint8_t* codes, const P* params, uint16_t* out, int64_t K, int64_t G) const {
    row<true>(codes, params, out, K, G);
  }

 private:
  template <bool kNatural, typename P>
  void row(const uint8_t* codes, const P* params, uint16_t* out, int64_t K, int64_t G) const {
    RunGroups run_groups(G);
    for (int64_t b = 0; b < K; run_groups.next_run(b += 64)) {
      __m512bh w[2];
      widen(codes + b / 2, table(params + run_groups.group * 2, run_groups.split(b)), w);
      for (int h = 0; h < 2; ++h) {
        const __m512i v = kNatural ? _mm512_permutex2var_epi16((__m512i)w[0], natural[h], (__m512i)w[1]) : (__m512i)w[h];
        _mm512_storeu_si512(out + b + 32 * h, v);
      }
    }
  }
};

}  // namespace kiln_int4
