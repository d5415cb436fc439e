// AVX2 helpers shared by Kiln's CPU kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <span>
#include <type_traits>

namespace kiln_simd {

// Sum of the eight lanes, in one fixed order (results are reproducible).
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

// hsum of four vectors at once, lane r = hsum(a_r) bit for bit: the same
// halves added first, then the same pairs (ten instructions for the four
// sums instead of sixteen).
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 u01 = _mm256_add_ps(_mm256_permute2f128_ps(a0, a1, 0x20), _mm256_permute2f128_ps(a0, a1, 0x31));
  const __m256 u23 = _mm256_add_ps(_mm256_permute2f128_ps(a2, a3, 0x20), _mm256_permute2f128_ps(a2, a3, 0x31));
  const __m256 pairs = _mm256_hadd_ps(u01, u23);    // a0 a0 a2 a2 | a1 a1 a3 a3
  const __m256 sums = _mm256_hadd_ps(pairs, pairs);  // a0 a2 a0 a2 | a1 a3 a1 a3
  return _mm_unpacklo_ps(_mm256_castps256_ps128(sums), _mm256_extractf128_ps(sums, 1));
}

// The largest of v's eight lanes (max is exact: any order gives the same value).
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// exp for x <= 0 (softmax after subtracting the max, sigmoid of -|x|);
// Cephes-style polynomial, relative error about 2e-7. Its constants are
// shared with simd512.h's sixteen-lane twin, which must compute alike.
namespace exp_poly {
constexpr float kLowest = -87.0f, kLog2e = 1.44269504088896341f, kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kHorner[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                             4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};  // highest power first
}  // namespace exp_poly

inline __m256 exp_nonpositive(__m256 x) {
  using namespace exp_poly;
  x = _mm256_max_ps(x, _mm256_set1_ps(kLowest));
  const __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Lo), _mm256_fnmadd_ps(fx, _mm256_set1_ps(kLn2Hi), x));
  __m256 y = _mm256_set1_ps(kHorner[0]);
  for (const float c : std::span(kHorner).subspan(1)) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(n));
}

// Largest of s[0..n) (n >= 1), eight lanes at a time (a scalar loop was a
// chain of dependent maxes: a fifth of prefill attention's time at 500 tokens).
inline float max_of(const float* s, int64_t n) {
  float mx = s[0];
  int64_t t = 0;
  if (n >= 8) {
    __m256 vm = _mm256_loadu_ps(s);
    for (t = 8; t + 8 <= n; t += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + t));
    mx = hmax(vm);
  }
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

// Softmax of s[0..n) in place (s then holds probabilities); every kernel's
// softmax is this one, so decode and prefill attention round alike.
inline void softmax(float* s, int64_t n) {
  float mx = max_of(s, n);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
    _mm256_storeu_ps(s + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = hsum(vsum);
  if (t < n) {  // tail through the same polynomial, padded with -inf-like values
    alignas(32) float buf[8];
    for (int i = 0; i < 8; ++i) buf[i] = t + i < n ? s[t + i] - mx : -87.0f;
    _mm256_store_ps(buf, exp_nonpositive(_mm256_load_ps(buf)));
    for (int64_t i = 0; t + i < n; ++i) { s[t + i] = buf[i]; sum += buf[i]; }
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// bf16 <-> fp32 in eight lanes. Narrowing rounds to nearest even and makes
// NaN 0x7fc0, bit for bit as c10::BFloat16(float) does, so a kernel and
// torch's bf16 ops round alike.
inline __m256 widen8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// v rounded to bf16, as fp32 bits (low 16 bits zero).
inline __m256i bf16_round_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  const __m256i kept = _mm256_and_si256(rounded, _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(kept, _mm256_set1_epi32(0x7fc00000), nan);
}

inline void narrow8(c10::BFloat16* p, __m256 v) {
  const __m256i hi = _mm256_srli_epi32(bf16_round_bits(v), 16);  // 0..65535 per lane
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// The steps of an 8 x 8 transpose for V = __m256 and, in the AVX-512 builds,
// __m512 (two 8 x 8 blocks side by side, one per 256-bit half).
inline __m256 unpacklo(__m256 a, __m256 b) { return _mm256_unpacklo_ps(a, b); }
inline __m256 unpackhi(__m256 a, __m256 b) { return _mm256_unpackhi_ps(a, b); }
template <int kImm>
inline __m256 shuffle(__m256 a, __m256 b) { return _mm256_shuffle_ps(a, b, kImm); }
// Per 256 bits: 128-bit lane kHalf of a, then that of b.
template <int kHalf>
inline __m256 lane_halves(__m256 a, __m256 b) { return _mm256_permute2f128_ps(a, b, kHalf ? 0x31 : 0x20); }
#ifdef __AVX512F__
inline __m512 unpacklo(__m512 a, __m512 b) { return _mm512_unpacklo_ps(a, b); }
inline __m512 unpackhi(__m512 a, __m512 b) { return _mm512_unpackhi_ps(a, b); }
template <int kImm>
inline __m512 shuffle(__m512 a, __m512 b) { return _mm512_shuffle_ps(a, b, kImm); }
template <int kHalf>
inline __m512 lane_halves(__m512 a, __m512 b) {
  const __m512i index = kHalf ? _mm512_setr_epi32(4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31)
                              : _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
  return _mm512_permutex2var_ps(a, index, b);
}
#endif

// Eight rows of eight floats -> their eight columns (r[i] becomes column i;
// a __m512 transposes the rows of each 256-bit half on their own).
template <typename V>
inline void transpose8(V r[8]) {
  V t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = unpacklo(r[i], r[i + 1]);
    t[i + 1] = unpackhi(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i], t[i + 2]);
    s[i + 1] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i], t[i + 2]);
    s[i + 2] = shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[i + 1], t[i + 3]);
    s[i + 3] = shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = lane_halves<0>(s[i], s[i + 4]);
    r[i + 4] = lane_halves<1>(s[i], s[i + 4]);
  }
}

// Eight values as fp32 lanes: fp32 as stored, 16-bit floats and int8 widened.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) { return widen8(p); }
inline __m256 load8(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// ... and back (fp32 or bf16, rounded as c10 rounds).
inline void store8f(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8f(c10::BFloat16* p, __m256 v) { narrow8(p, v); }
inline void store8f(c10::Half* p, __m256 v) {  // nearest even, as c10::Half(float) rounds
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

// v as it would be after a store to T and a load back (identity for fp32):
// where torch's bf16 reference rounds an intermediate, kernels round it too.
template <typename T>
inline __m256 round_as(__m256 v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return _mm256_castsi256_ps(bf16_round_bits(v));
}
template <typename T>
inline float round_as(float v) {
  return static_cast<float>(static_cast<T>(v));
}

}  // namespace kiln_simd
