// int4 weights (linear_f32.cpp's Int4Problem layout) or Q8_0 blocks times
// more than eight fp32 x rows, with the bits of the eight-lane kernels
// (linear_w4's, linear_q8_0's = linear_f32's on the dequantized weight), as
// an outer-product GEMM (the avx512 and avx512_vnni builds: KILN_AVX512).
//
// The int4 kernel computes every output as eight partial sums, lane l of an
// eight-lane accumulator holding fma(x[k], w[k], .) for k = l, l + 8, ...
// in that order from 0, then sums the lanes as kiln_simd::hsum does:
// ((a0 + a4) + (a1 + a5)) + ((a2 + a6) + (a3 + a7)). Each lane's chain is a
// dot product over the k of one residue mod 8, so the eight of them for a
// block of outputs are eight small GEMMs. Here a panel of kPanel weight rows
// is widened once per call straight from the codes (each weight q * scale +
// min by widen_row's FMA: the same weights) into a lane-major layout,
// panel[l][k / 8][kPanel], and x is packed lane major once per call; every
// block of x rows then runs, for each lane, an outer-product pass over the
// panel (one broadcast of x and kVecs FMAs per row and k / 8, no shuffles,
// no sums across lanes), stores the eight partial sums, and adds them in
// hsum's order with vertical adds: the same FMAs in the same order, the same
// bits as the int4 kernel at any M. Q8_0 blocks (code * block scale, exact
// in fp32: the dequantized weight) go the same way: linear_q8_0 is
// linear_f32's chain, which is the int4 kernel's over other weights.
// The int4 kernel's own tiles (rows widened into a buffer, two weight rows
// per vector: an insert per pair, a sum across lanes per output) remain the
// avx2 build's. Ice Lake, SmolLM2's four shapes x 30 layers, 2 threads, in
// one process (outputs asserted equal), those tiles / these panels: 1.07-1.20x
// faster at 9-16 rows, 1.25-1.31x at 32-64, 1.32-1.44x at 128-192; from 192
// rows linear_w4_panels (other bits) is 1.0-1.08x faster still.
#pragma once
#if KILN_AVX512
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <utility>
#include <vector>

#include "int4_widen.h"
#include "parallel_chunks.h"
#include "simd.h"

namespace kiln_lane_panels {

constexpr int kLanes = 8;  // the int4 kernel's eight-lane chains
// Three vectors of outputs by eight x rows: 24 accumulators, three loads and
// eight broadcasts a step. Two vectors (16 accumulators) ran 1.07-1.13x slower
// at 16-128 rows (Ice Lake, 2 threads).
#ifndef KILN_LANE_PANEL_VECS
#define KILN_LANE_PANEL_VECS 3
#endif
constexpr int kVecs = KILN_LANE_PANEL_VECS;  // sixteen-float vectors of outputs per panel
constexpr int64_t kPanel = 16 * kVecs;       // weight rows per panel
constexpr int kRows = 8;                     // x rows per pass: kRows x kVecs accumulators

// x [M, K] packed lane major in blocks of kRows rows: xp[((b * kLanes + l) *
// K / 8 + k / 8) * kRows + r] = x[b * kRows + r, k + l], zero past row M, so
// a pass's broadcasts read one sequential stream.
inline void pack_x(const float* x, int64_t M, int64_t K, float* xp) {
  const int64_t kk_count = K / kLanes;
  for (int64_t b = 0; b * kRows < M; ++b)
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i)
        r[i] = b * kRows + i < M ? _mm256_loadu_ps(x + (b * kRows + i) * K + k) : _mm256_setzero_ps();
      kiln_simd::transpose8(r);  // r[l]: x[rows, k + l]
      for (int l = 0; l < kLanes; ++l) _mm256_storeu_ps(xp + ((b * kLanes + l) * kk_count + k / 8) * kRows, r[l]);
    }
}

// Word l of sixteen rows' runs of 64 codes (Int4Problem's layout: word l of
// a run holds its weights l, l + 8, ... l + 56, one per nibble): v[l] lane i
// from row i (rows from `count` on read as zero). Rows i and i + 8 share a
// vector and an eight-word transpose runs in each half.
inline void run_words(const uint8_t* run, int64_t row_stride, int count, __m512 (&v)[kLanes]) {
  const auto words = [&](int i) {
    return i < count ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + i * row_stride))
                     : _mm256_setzero_si256();
  };
  for (int i = 0; i < 8; ++i)
    v[i] = _mm512_castsi512_ps(_mm512_inserti64x4(_mm512_castsi256_si512(words(i)), words(i + 8), 1));
  kiln_simd::transpose8(v);
}

// Scale and min of one group for sixteen rows, lane i from row i's params at
// p + i * row_step (rows outside `valid` zero): the values group_params gives.
inline void group_params16(const uint16_t* p, int64_t row_step, __mmask16 valid, __m512& scale, __m512& min) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(row_step / 2)));
  const __m512i pairs = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), valid, index, p, 4);
  scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(pairs));
  min = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(pairs, 16)));
}
inline void group_params16(const float* p, int64_t row_step, __mmask16 valid, __m512& scale, __m512& min) {
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(row_step)));
  scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, index, p, 4);
  min = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, index, p + 1, 4);
}

// Weight rows [n0, n0 + cols) widened straight from their codes into the
// panel, lane major: panel[(l * K / 8 + k / 8) * kPanel + j] = w[n0 + j, k + l]
// (k a multiple of 8; rows past `cols` zero), each weight q * scale + min by
// one FMA as widen_row computes it. Sixteen rows at a time: nibble s of
// their word l is weight 8s + l of the run, sixteen rows in one vector.
template <typename P>
void widen_panel(const uint8_t* codes, const P* params, int64_t K, int64_t G, int64_t n0, int64_t cols, float* panel) {
  const int64_t groups = K / G, kk_count = K / kLanes, row_stride = K / 2;
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  for (int64_t r0 = 0; r0 < kPanel; r0 += 16) {
    const int count = static_cast<int>(std::clamp<int64_t>(cols - r0, 0, 16));
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    const uint8_t* rows = codes + (n0 + r0) * row_stride;
    const P* p = params + (n0 + r0) * groups * 2;
    kiln_int4::RunGroups run_groups(G);
    for (int64_t b = 0; b < K; run_groups.next_run(b += 64)) {
      __m512 scale[2], min[2];  // [half of the run]: weights 32 h .. 32 h + 31
      group_params16(p + run_groups.group * 2, groups * 2, valid, scale[0], min[0]);
      if (run_groups.split(b))
        group_params16(p + (run_groups.group + 1) * 2, groups * 2, valid, scale[1], min[1]);
      else
        scale[1] = scale[0], min[1] = min[0];
      __m512 words[kLanes];
      run_words(rows + b / 2, row_stride, count, words);
      for (int l = 0; l < kLanes; ++l) {
        const __m512i w = _mm512_castps_si512(words[l]);
        float* out = panel + (l * kk_count + b / 8) * kPanel + r0;
        for (int s = 0; s < 8; ++s) {
          const __m512i q = _mm512_and_si512(s ? _mm512_srli_epi32(w, 4 * s) : w, low4);
          _mm512_store_ps(out + s * kPanel, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale[s / 4], min[s / 4]));
        }
      }
    }
  }
}

// The same for Q8_0 blocks (codes int8 [N, K], scales [N, K / 32]): each
// weight code * its block's scale, as linear_q8_0 forms it. A block of 32
// codes of sixteen rows is eight 32-bit words a row: transposed (run_words),
// word d holds codes 4d .. 4d + 3 of all sixteen rows, byte t of each brought
// down and sign-extended by two shifts.
inline void widen_panel_q8(const int8_t* codes, const float* scales, int64_t K, int64_t n0, int64_t cols,
                           float* panel) {
  constexpr int64_t kBlock = 32;
  const int64_t blocks = K / kBlock, kk_count = K / kLanes;
  const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(static_cast<int>(blocks)));
  for (int64_t r0 = 0; r0 < kPanel; r0 += 16) {
    const int count = static_cast<int>(std::clamp<int64_t>(cols - r0, 0, 16));
    const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
    const uint8_t* rows = reinterpret_cast<const uint8_t*>(codes + (n0 + r0) * K);
    const float* row_scales = scales + (n0 + r0) * blocks;
    for (int64_t b = 0; b < blocks; ++b) {
      const __m512 scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, index, row_scales + b, 4);
      __m512 words[kLanes];
      run_words(rows + b * kBlock, K, count, words);
      for (int d = 0; d < kLanes; ++d) {
        const __m512i w = _mm512_castps_si512(words[d]);
        [&]<int... T>(std::integer_sequence<int, T...>) {
          ([&] {
            const int64_t k = b * kBlock + 4 * d + T;  // this byte's k: lane k % 8 of step k / 8
            const __m512i q = _mm512_srai_epi32(T == 3 ? w : _mm512_slli_epi32(w, 24 - 8 * T), 24);
            _mm512_store_ps(panel + ((k % kLanes) * kk_count + k / kLanes) * kPanel + r0,
                            _mm512_mul_ps(_mm512_cvtepi32_ps(q), scale));
          }(), ...);
        }(std::make_integer_sequence<int, 4>{});
      }
    }
  }
}

// y[m, n0 ..] for the first R rows of a packed block of x (pack_x; y's row
// stride N) against the panel; `cols` of its kPanel outputs are stored.
// part: kLanes * R * kPanel floats of scratch.
template <int R>
void rows_pass(const float* xp, int64_t K, const float* panel, float* part, float* y, int64_t N, int64_t cols) {
  const int64_t kk_count = K / kLanes;
  for (int l = 0; l < kLanes; ++l) {
    __m512 acc[R][kVecs];
    for (int m = 0; m < R; ++m)
      for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_setzero_ps();
    const float* w = panel + l * kk_count * kPanel;
    const float* xl = xp + l * kk_count * kRows;
    for (int64_t kk = 0; kk < kk_count; ++kk) {
      __m512 wv[kVecs];
      for (int v = 0; v < kVecs; ++v) wv[v] = _mm512_load_ps(w + kk * kPanel + 16 * v);
      for (int m = 0; m < R; ++m) {
        const __m512 xv = _mm512_set1_ps(xl[kk * kRows + m]);
        for (int v = 0; v < kVecs; ++v) acc[m][v] = _mm512_fmadd_ps(xv, wv[v], acc[m][v]);
      }
    }
    for (int m = 0; m < R; ++m)
      for (int v = 0; v < kVecs; ++v) _mm512_store_ps(part + ((l * R + m) * kVecs + v) * 16, acc[m][v]);
  }
  for (int m = 0; m < R; ++m)
    for (int v = 0; v < kVecs; ++v) {
      __m512 a[kLanes];
      for (int l = 0; l < kLanes; ++l) a[l] = _mm512_load_ps(part + ((l * R + m) * kVecs + v) * 16);
      const __m512 sum = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[1], a[5])),
                                       _mm512_add_ps(_mm512_add_ps(a[2], a[6]), _mm512_add_ps(a[3], a[7])));
      const int64_t left = std::clamp<int64_t>(cols - 16 * v, 0, 16);
      _mm512_mask_storeu_ps(y + m * N + 16 * v, static_cast<__mmask16>((1u << left) - 1), sum);
    }
}

// y[M, N] = x[M, K] @ W^T, widen(n0, cols, panel) filling a panel with
// weight rows [n0, n0 + cols) lane major (widen_panel, widen_panel_q8).
template <typename Widen>
void run_panels(const float* x, float* y, int64_t M, int64_t N, int64_t K, const Widen& widen) {
  using Pass = void (*)(const float*, int64_t, const float*, float*, float*, int64_t, int64_t);
  static constexpr auto passes = []<int... I>(std::integer_sequence<int, I...>) {
    return std::array<Pass, kRows>{&rows_pass<I + 1>...};
  }(std::make_integer_sequence<int, kRows>{});
  const int64_t panels = (N + kPanel - 1) / kPanel;
  thread_local std::vector<float> packed;
  packed.resize((M + kRows - 1) / kRows * kRows * K);
  pack_x(x, M, K, packed.data());
  const float* xp = packed.data();
  kiln_parallel::guided_for(panels, 1, [&] {
    // This thread's buffers, for every panel it claims.
    return [&, panel = std::unique_ptr<float, decltype(&std::free)>(
                static_cast<float*>(std::aligned_alloc(64, kPanel * K * sizeof(float))), &std::free),
            part = std::unique_ptr<float, decltype(&std::free)>(
                static_cast<float*>(std::aligned_alloc(64, kLanes * kRows * kPanel * sizeof(float))), &std::free)](
               int64_t begin, int64_t end) mutable {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        widen(n0, cols, panel.get());
        for (int64_t m = 0; m < M; m += kRows)
          passes[std::min<int64_t>(kRows, M - m) - 1](xp + m * K, K, panel.get(), part.get(), y + m * N + n0, N, cols);
      }
    };
  });
}

// y[M, N] = x[M, K] @ W^T for int4 codes [N, K / 2] with (scale, min) per group of G.
template <typename P>
void run(const float* x, const uint8_t* codes, const P* params, float* y, int64_t M, int64_t N, int64_t K, int64_t G) {
  run_panels(x, y, M, N, K,
             [&](int64_t n0, int64_t cols, float* panel) { widen_panel(codes, params, K, G, n0, cols, panel); });
}

// y[M, N] = x[M, K] @ W^T for Q8_0 codes int8 [N, K] with fp32 scales [N, K / 32].
inline void run_q8_0(const float* x, const int8_t* codes, const float* scales, float* y, int64_t M, int64_t N,
                     int64_t K) {
  run_panels(x, y, M, N, K,
             [&](int64_t n0, int64_t cols, float* panel) { widen_panel_q8(codes, scales, K, n0, cols, panel); });
}

}  // namespace kiln_lane_panels
#endif
