// fp32-activation linear for CPU: y[M,N] = x[M,K] @ w[N,K]^T, weights as
// stored: fp32, bf16, int8 with a per-row scale, int8 in GGUF's Q8_0 blocks
// of 32 with a scale each (a kept Q8_0 LM head), or int4 in groups with an
// fp16 or fp32 scale and min per group (weight-only quantization; the codes
// are widened in registers, never in memory). bf16 weights here are the AVX2
// build's `linear_bf16` (fp32 arithmetic); the AVX512_BF16 build has its own
// (linear_bf16.cpp, bf16 dot products).
//
// Every output is a dot product of an x row and a w row, accumulated along K
// eight lanes at a time, then summed across lanes and the K tail in a fixed
// order. Which micro-kernel computes it (how many x rows and w rows share a
// pass) changes only the speed, never the bits: a row's result does not
// depend on M or on the other rows (batch invariance).
//
// Micro-kernel shapes (tiling and threading in linear_tiling.h):
// - M <= 8 (decode, speculative verification): all rows against one w row
//   (for M = 1: four w rows in the avx2 build, one in the avx512_bf16 build,
//   see KILN_DENSE_SINGLE_ROW_COLS), so each weight row leaves memory once;
//   the step is bandwidth-bound.
// - M > 8: 4 x rows by 3 w rows, 12 accumulators in registers, 7 loads per
//   12 FMAs; the step is compute-bound.
// The avx512 build runs int4, fp32 and bf16 weights in pairs of rows, each
// pair's two eight-lane chains in one sixteen-lane vector (the same bits;
// see DenseProblem and Int4Problem for the shapes); int4 at M > 8 takes the
// outer-product passes of lane_panels.h (the same bits again).
//
// Built with -fopenmp: ATen's parallel_for is a header template that runs
// serially when the including file is compiled without OpenMP.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <type_traits>
#include <utility>
#include <vector>

#include "lane_panels.h"
#include "int4_widen.h"
#include "kernels.h"
#include "linear_tiling.h"
#include "simd.h"

namespace {

using kiln_simd::hsum;

// Eight weights as floats: fp32 as stored, bf16 and int8 widened (int8's
// per-row scale is applied once to the finished dot product).
using kiln_simd::load8;

// A problem is y[M, N] = x[M, K] @ W^T for one weight format; its micro<MR,
// NR>(m, n) computes y[m .. m+MR, n .. n+NR]. Kernels<P> below tiles and
// threads any of them the same way.

// Weight rows per pass for a single x row (macros for tuning experiments).
// Zen 3 (the avx2 build's home) ran fastest with four rows, for enough
// independent FMA chains; on Zen 4 (the avx512_bf16 build's) one row at a
// time, a single sequential stream per thread, reads 1.5x faster
// (docs/benchmarks.md). Int4 is compute-bound either way.
#ifndef KILN_DENSE_SINGLE_ROW_COLS
#ifdef KILN_AVX512_BF16
#define KILN_DENSE_SINGLE_ROW_COLS 1
#else
#define KILN_DENSE_SINGLE_ROW_COLS 4
#endif
#endif
#ifndef KILN_INT4_SINGLE_ROW_COLS
#define KILN_INT4_SINGLE_ROW_COLS 4
#endif

// Weights per scale of a Q8_0 block (GGUF): int8 codes, one scale per 32.
constexpr int64_t kQ8Block = 32;

// The narrow int4 passes (M <= 8, fp32 x) in pairs of weight rows sixteen
// lanes wide (Int4Problem::pair_micro): the AVX-512 builds, avx512_bf16
// included, whose other fp32 kernels stay eight lanes wide. On Zen 4 the
// 120 projections of SmolLM2's shapes at one row (2 threads, one process)
// ran 4.49 ms against 4.82 for the eight-lane passes (1.07x; the same bits),
// but 0.92-0.98x at 3-6 rows: there the avx512_bf16 build pairs one row only.
#if KILN_AVX512 || KILN_AVX512_BF16
#define KILN_INT4_PAIRS 1
#else
#define KILN_INT4_PAIRS 0
#endif

#if KILN_AVX512
constexpr bool kAvx512Build = true;
#else
constexpr bool kAvx512Build = false;
#endif

#if KILN_INT4_PAIRS
// Eight weights of row a in the low eight lanes and eight of row b in the
// high eight, each widened as load8 widens it: the operand of the pair
// micro-kernels, which run two weight rows' eight-lane chains in one vector.
inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}
inline __m512 load_pair(const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m256i both = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(both), 16));
}

// sums[m][2j] and sums[m][2j + 1]: the lane sums of acc[m][j]'s low and high
// eight lanes (the two weight rows of pair j), as kiln_linear::lane_sums sums
// eight-lane accumulators.
template <int MR, int NP>
inline void pair_lane_sums(const __m512 (&acc)[MR][NP], float (&sums)[MR][2 * NP]) {
  __m256 halves[MR][2 * NP];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NP; ++j) {
      halves[m][2 * j] = _mm512_castps512_ps256(acc[m][j]);
      halves[m][2 * j + 1] = _mm512_extractf32x8_ps(acc[m][j], 1);
    }
  kiln_linear::lane_sums<MR, 2 * NP>(halves, sums);
}
#endif

// fp32, bf16 or int8 weight rows [N, K] (int8: scale[n] applied to the
// finished sum; with kBlockScales, Q8_0 blocks: each weight times its
// block's fp32 scale, block_scale[n, k / 32], in registers: an int8 code
// times an fp16-exact scale is exact in fp32, so w equals the float weight
// gguf dequantizes, and the dot product is the fp32 kernel's, bit for bit).
template <typename W, bool kBlockScales = false>
struct DenseProblem {
  // The avx512 build runs fp32 and bf16 weights in pairs of rows sixteen
  // lanes wide (pair_micro): Ice Lake, SmolLM2's four shapes, 2 threads, in
  // one process: the wide 8 x 6 block (8 x 3 pairs) 1.3-1.45x the 4 x 3 at
  // 16 and 64 rows; bf16 at 4 and 8 rows, two pairs a pass, 1.3-1.6x; up to
  // 8 rows of fp32 and 2 of bf16 as fast either way (bandwidth-bound). Paired
  // int8 (an insert and a sign extension per vector, both on one port) ran
  // 1.1-1.3x slower.
  static constexpr bool kPaired = kAvx512Build && !std::is_same_v<W, int8_t>;
  static constexpr int kWideRows = kPaired ? 8 : 4, kWideCols = kPaired ? 6 : 3;
  static constexpr int kSingleRowCols = KILN_DENSE_SINGLE_ROW_COLS;
  static constexpr int narrow_cols(int m) {
    return kPaired && std::is_same_v<W, c10::BFloat16> ? 4 : kiln_linear::narrow_cols(m);
  }
  const float* x;
  const W* w;
  const float* scale;
  float* y;
  int64_t K, N;
  const float* block_scale = nullptr;  // [N, K / kQ8Block] with kBlockScales

  int64_t row_bytes() const { return K * static_cast<int64_t>(sizeof(W)); }
  int64_t x_row_bytes() const { return K * 4; }

  // y[m0 + m, n0 + n] from its eight-lane sums: the K tail, then the row scale.
  template <int MR, int NR>
  void finish(const float (&sums)[MR][NR], const float* xr, const W* wr, int64_t m0, int64_t n0, int64_t k) const {
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) {
        float s = sums[m][n];
        for (int64_t t = k; t < K; ++t) s += xr[m * K + t] * static_cast<float>(wr[n * K + t]);
        y[(m0 + m) * N + n0 + n] = scale ? s * scale[n0 + n] : s;
      }
  }

#if KILN_AVX512
  // As micro<MR, 2 * NP>, sixteen lanes at a time: weight rows n0 + 2j and
  // n0 + 2j + 1 share a vector (load_pair) and each x row's eight values are
  // broadcast to both halves, so every (x row, weight row) pair keeps its own
  // eight-lane chain, updated by the same operations in the same order: the
  // bits of micro<MR, 2 * NP> with half the widening and FMA instructions.
  template <int MR, int NP>
  void pair_micro(int64_t m0, int64_t n0) const {
    static_assert(kPaired);
    const float* __restrict xr = x + m0 * K;
    const W* __restrict wr = w + n0 * K;
    __m512 acc[MR][NP];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      if ((k * sizeof(W)) % 64 == 0) kiln_linear::prefetch_ahead<2 * NP>(wr, row_bytes(), k * sizeof(W));
      __m512 wv[NP];
      for (int j = 0; j < NP; ++j) wv[j] = load_pair(wr + 2 * j * K + k, wr + (2 * j + 1) * K + k);
      for (int m = 0; m < MR; ++m) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + m * K + k));
        for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
      }
    }
    float sums[MR][2 * NP];
    pair_lane_sums<MR, NP>(acc, sums);
    finish<MR, 2 * NP>(sums, xr, wr, m0, n0, k);
  }
#endif

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
#if KILN_AVX512
    if constexpr (kPaired && NR % 2 == 0) {
      pair_micro<MR, NR / 2>(m0, n0);
      return;
    }
#endif
    const float* __restrict xr = x + m0 * K;
    const W* __restrict wr = w + n0 * K;
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      // The next NR weight rows follow these in memory: request them a line
      // at a time while these are computed (the hardware prefetcher alone
      // falls behind on int8 rows, which take a quarter of fp32's compute per
      // line).
      if ((k * sizeof(W)) % 64 == 0) kiln_linear::prefetch_ahead<NR>(wr, row_bytes(), k * sizeof(W));
      __m256 wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = load8(wr + n * K + k);
      if constexpr (kBlockScales)
        for (int n = 0; n < NR; ++n)
          wv[n] = _mm256_mul_ps(wv[n], _mm256_set1_ps(block_scale[(n0 + n) * (K / kQ8Block) + k / kQ8Block]));
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_loadu_ps(xr + m * K + k);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
      }
    }
    float sums[MR][NR];
    kiln_linear::lane_sums<MR, NR>(acc, sums);
    finish<MR, NR>(sums, xr, wr, m0, n0, k);
  }
};

// int4 weights in groups of G along K (G % 32 == 0, K % 64 == 0, K % G == 0):
// codes [N, K/2] bytes, each run of 64 weights of a row as eight
// little-endian 32-bit words, word j holding weight 8s + j of the run in bits
// 4s .. 4s+3 (s = 0..7): eight weights, one per lane, come out of one
// register with a shift and a mask, no byte shuffles. scale_min
// [N, K/G, 2] (scale, min): w = q * scale + min, dequantized in registers
// with one FMA; then the dot product runs as for fp32 weights. The
// parameters are fp16 (uint16_t bits: Kiln's own quantization, GGUF Q4_0/Q4_1)
// or fp32 (P = float: pre-quantized checkpoints whose scale and min are not
// exact in fp16, e.g. GPTQ/AWQ zero points, GGUF Q4_K's 6-bit sub-scales).
template <typename P>
struct Int4Problem {
  static constexpr int kWideRows = 4, kWideCols = 3, kSingleRowCols = KILN_INT4_SINGLE_ROW_COLS;
#if KILN_AVX512
  // Two pairs of weight rows a pass (pair_micro) at every M <= 8. Ice Lake,
  // SmolLM2's four shapes, 2 threads, in one process: 1.2-1.9x the eight-lane
  // passes at M = 1..8; one pair at M > 4 ran 1.2-1.3x slower than two.
  static constexpr int narrow_cols(int) { return 4; }
#endif
  const float* x;
  const uint8_t* codes;
  const P* scale_min;
  float* y;
  int64_t K, N, G;

  int64_t row_bytes() const { return K / 2; }
  int64_t x_row_bytes() const { return K * 4; }

  // (scale, min) of the group holding weight b of a row, then (when the
  // run's second half lies in the next group) those of that group, as four floats.
  static __m128 params(const P* p, bool two_groups) {
    if constexpr (std::is_same_v<P, float>) {
      return two_groups ? _mm_loadu_ps(p) : _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
    } else {
      return _mm_cvtph_ps(two_groups ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))
                                     : _mm_cvtsi32_si128(static_cast<int>(p[0] | (uint32_t{p[1]} << 16))));
    }
  }

#if KILN_INT4_PAIRS
  // As micro<MR, 2 * NP>, sixteen lanes at a time: weight rows n + 2j and
  // n + 2j + 1 share a vector (low and high eight lanes: their words side by
  // side, their scales and mins spread by one permute each), each x row's
  // eight values are broadcast to both halves, and a code becomes its float
  // by a table lookup (the permute reads only an index's low four bits, so
  // no mask; the table holds 0.0 .. 15.0, what the convert gives). Every
  // (x row, weight row) pair keeps its own eight-lane chain, updated by the
  // same FMAs in the same order: the bits of the eight-lane kernel.
  template <int MR, int NP>
  void pair_micro(int64_t m0, int64_t n0) const {
    const float* __restrict xr = x + m0 * K;
    const int64_t row_stride = K / 2, groups = K / G;
    const __m512 codes_as_floats = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    // Lanes of [row n's params(), row n+1's]: scale and min of the run's first half, then of its second.
    const __m512i first_scale = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
    const __m512i one = _mm512_set1_epi32(1), two = _mm512_set1_epi32(2);
    __m512 acc[MR][NP];
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_setzero_ps();
    kiln_int4::RunGroups run_groups(G);
    for (int64_t b = 0; b < K; run_groups.next_run(b += 64)) {
      const uint8_t* run = codes + n0 * row_stride + b / 2;
      if (b % 128 == 0) kiln_linear::prefetch_ahead<2 * NP>(codes + n0 * row_stride, row_stride, b / 2);
      const bool split = run_groups.split(b);
      const __m512i second_scale = split ? _mm512_add_epi32(first_scale, two) : first_scale;
      __m512i words[NP];
      __m512 sv[NP][2], mv[NP][2];  // [pair][half of the run]
      for (int j = 0; j < NP; ++j) {
        const int64_t n = n0 + 2 * j;
        words[j] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + 2 * j * row_stride))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + (2 * j + 1) * row_stride)), 1);
        const P* p = scale_min + (n * groups + run_groups.group) * 2;
        const __m512 f = _mm512_castps256_ps512(_mm256_set_m128(params(p + groups * 2, split), params(p, split)));
        sv[j][0] = _mm512_permutexvar_ps(first_scale, f);
        mv[j][0] = _mm512_permutexvar_ps(_mm512_add_epi32(first_scale, one), f);
        sv[j][1] = _mm512_permutexvar_ps(second_scale, f);
        mv[j][1] = _mm512_permutexvar_ps(_mm512_add_epi32(second_scale, one), f);
      }
      [&]<int... S>(std::integer_sequence<int, S...>) {
        ([&] {
          __m512 wv[NP];
          for (int j = 0; j < NP; ++j) {
            const __m512 q = _mm512_permutexvar_ps(S ? _mm512_srli_epi32(words[j], 4 * S) : words[j], codes_as_floats);
            wv[j] = _mm512_fmadd_ps(q, sv[j][S / 4], mv[j][S / 4]);
          }
          for (int m = 0; m < MR; ++m) {
            const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xr + m * K + b + 8 * S));
            for (int j = 0; j < NP; ++j) acc[m][j] = _mm512_fmadd_ps(xv, wv[j], acc[m][j]);
          }
        }(), ...);
      }(std::make_integer_sequence<int, 8>{});
    }
    float sums[MR][2 * NP];
    pair_lane_sums<MR, NP>(acc, sums);
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < 2 * NP; ++n) y[(m0 + m) * N + n0 + n] = sums[m][n];
  }
#endif

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
#if KILN_INT4_PAIRS
    // avx512_bf16: one x row only (pairs at 3-6 rows ran 0.92-0.98x there).
    if constexpr (NR % 2 == 0 && (kAvx512Build || MR == 1)) {
      pair_micro<MR, NR / 2>(m0, n0);
      return;
    }
#endif
    const float* __restrict xr = x + m0 * K;
    const int64_t row_stride = K / 2, groups = K / G;
    const __m256i low4 = _mm256_set1_epi32(0x0F);
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    kiln_int4::RunGroups run_groups(G);
    for (int64_t b = 0; b < K; run_groups.next_run(b += 64)) {
      const uint8_t* run = codes + n0 * row_stride + b / 2;
      if (b % 128 == 0)  // the next rows, a line at a time (see DenseProblem)
        kiln_linear::prefetch_ahead<NR>(codes + n0 * row_stride, row_stride, b / 2);
      __m256i words[NR];
      __m256 sv[NR][2], mv[NR][2];  // [n][half of the run]: groups of 32 change mid-run
      // The run's second half starts the next group when G is 32 or an odd multiple of it (G = 96: b = 64).
      const bool split = run_groups.split(b);
      for (int n = 0; n < NR; ++n) {
        words[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(run + n * row_stride));
        const __m128 f = params(scale_min + ((n0 + n) * groups + run_groups.group) * 2, split);
        sv[n][0] = _mm256_broadcastss_ps(f);
        mv[n][0] = _mm256_broadcastss_ps(_mm_shuffle_ps(f, f, 1));
        sv[n][1] = split ? _mm256_broadcastss_ps(_mm_shuffle_ps(f, f, 2)) : sv[n][0];
        mv[n][1] = split ? _mm256_broadcastss_ps(_mm_shuffle_ps(f, f, 3)) : mv[n][0];
      }
      // Weights b + 8s .. b + 8s + 7: nibble s of every word.
      [&]<int... S>(std::integer_sequence<int, S...>) {
        ([&] {
          __m256 wv[NR];
          for (int n = 0; n < NR; ++n) {
            const __m256i q = _mm256_and_si256(S ? _mm256_srli_epi32(words[n], 4 * S) : words[n], low4);
            wv[n] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sv[n][S / 4], mv[n][S / 4]);
          }
          for (int m = 0; m < MR; ++m) {
            const __m256 xv = _mm256_loadu_ps(xr + m * K + b + 8 * S);
            for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
          }
        }(), ...);
      }(std::make_integer_sequence<int, 8>{});
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = hsum(acc[m][n]);
  }
};

template <typename P>
using Kernels = kiln_linear::Kernels<P>;

void check_operands(const at::Tensor& x, const at::Tensor& w, int64_t k, at::ScalarType wtype, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == k, name, ": shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == wtype, name, ": operand dtypes");
  TORCH_CHECK(w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(), name, ": contiguous CPU weight required");
}

template <typename W, bool kBlockScales = false>
at::Tensor dense(const at::Tensor& x_in, const at::Tensor& w, const float* scale, const float* block_scale = nullptr) {
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
  const DenseProblem<W, kBlockScales> p{x.const_data_ptr<float>(), w.const_data_ptr<W>(), scale,
                                        y.mutable_data_ptr<float>(), x.size(1), w.size(0), block_scale};
  Kernels<DenseProblem<W, kBlockScales>>::run(p, x.size(0));
  return y;
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w, w.size(1), at::kFloat, "linear_f32");
  return dense<float>(x, w, nullptr);
}

// x fp32 [M, K] @ (w int8 [N, K] * scales fp32 [N])^T, activations kept in fp32.
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_in) {
  check_operands(x, w, w.size(1), at::kChar, "linear_w8");
  const at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0), "linear_w8: fp32 scales [N] required");
  return dense<int8_t>(x, w, scales.const_data_ptr<float>());
}

// x fp32 [M, K] @ (Q8_0 blocks: w int8 [N, K] * scales fp32 [N, K / 32] per block)^T:
// bit-identical to linear_f32 on the dequantized weight (see DenseProblem).
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_in) {
  check_operands(x, w, w.size(1), at::kChar, "linear_q8_0");
  TORCH_CHECK(w.size(1) % kQ8Block == 0, "linear_q8_0: K must be a multiple of 32");
  const at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0) * (w.size(1) / kQ8Block),
              "linear_q8_0: fp32 scales [N, K / 32] required");
#if KILN_AVX512
  if (x.size(0) > kiln_linear::kNarrowMaxRows) {
    const at::Tensor xc = x.contiguous();
    at::Tensor y = at::empty({x.size(0), w.size(0)}, x.options());
    kiln_lane_panels::run_q8_0(xc.const_data_ptr<float>(), w.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                               y.mutable_data_ptr<float>(), x.size(0), w.size(0), w.size(1));
    return y;
  }
#endif
  return dense<int8_t, true>(x, w, nullptr, scales.const_data_ptr<float>());
}

#if !KILN_AVX512
// (The AVX-512 builds run more than eight rows through lane_panels.h.)
// K-blocked passes over widened weights for long rows (the down projection's
// K = 1536): four x rows and three weight rows over all of K (42 KB) overflow
// L1, and the wide micro-kernel ran 1.3x slower than at K = 576. Here each
// pass covers kWidenedKBlock of K, and the eight-lane accumulators of every
// (x row, weight row) pair wait in a per-thread buffer between blocks: the
// same FMAs in the same order, then the same hsum, so the bits are those of
// one pass over K.
constexpr int64_t kWidenedKBlock = 512;

struct WidenedKBlocks {
  const float* x;
  const float* w;  // widened weight rows [rows, K]
  float* y;        // y's row stride stays N
  float* acc;      // [row block rows, rows, 8]
  int64_t K, N, rows;

  template <int MR, int NR>
  void micro(int64_t m, int64_t n, int64_t m0, int64_t k0, int64_t k1) const {
    __m256 a[MR][NR];
    float* spill = acc + ((m - m0) * rows + n) * 8;
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j)
        a[i][j] = k0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(spill + (i * rows + j) * 8);
    for (int64_t k = k0; k < k1; k += 8) {
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = _mm256_loadu_ps(w + (n + j) * K + k);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + (m + i) * K + k);
        for (int j = 0; j < NR; ++j) a[i][j] = _mm256_fmadd_ps(xv, wv[j], a[i][j]);
      }
    }
    if (k1 == K) {
      float sums[MR][NR];
      kiln_linear::lane_sums<MR, NR>(a, sums);
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) y[(m + i) * N + n + j] = sums[i][j];
      return;
    }
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) _mm256_storeu_ps(spill + (i * rows + j) * 8, a[i][j]);
  }

  // x rows [m0, m1) against all the widened rows, k_block of K at a time.
  void run(int64_t m0, int64_t m1, int64_t k_block) const {
    using Fn = void (WidenedKBlocks::*)(int64_t, int64_t, int64_t, int64_t, int64_t) const;
    constexpr int WR = DenseProblem<float>::kWideRows, WC = DenseProblem<float>::kWideCols;
    static constexpr std::array<Fn, WR * WC> fns = []<int... I>(std::integer_sequence<int, I...>) {
      return std::array<Fn, WR * WC>{&WidenedKBlocks::micro<I / WC + 1, I % WC + 1>...};
    }(std::make_integer_sequence<int, WR * WC>{});
    for (int64_t k0 = 0; k0 < K; k0 += k_block) {
      const int64_t k1 = std::min(K, k0 + k_block);
      for (int64_t m = m0; m < m1; m += WR)
        for (int64_t n = 0; n < rows; n += WC)
          (this->*fns[(std::min<int64_t>(WR, m1 - m) - 1) * WC + std::min<int64_t>(WC, rows - n) - 1])(m, n, m0, k0, k1);
    }
  }
};

// More than kNarrowMaxRows x rows: Int4Problem's wide micro-kernel widens
// every weight again for each group of 4 x rows (16 times at 64 rows), and
// is compute-bound on it. Here each tile of weight rows is widened once into
// a per-thread fp32 buffer (widen_row: the kernel's own FMA, so the same
// weights) and every x row runs DenseProblem<float>'s wide micro-kernel on
// it (WidenedKBlocks' where K > 2 * kWidenedKBlock): per output the same chain
// (acc = fma(x, w, acc) 8 lanes along K, then hsum; K % 64 == 0 leaves no
// tail), so the bits are Int4Problem's.
template <typename P>
void run_w4_tiles(const Int4Problem<P>& p, int64_t M) {
  using Dense = DenseProblem<float>;
  constexpr int WR = Dense::kWideRows, WC = Dense::kWideCols;
  const int64_t K = p.K;
  constexpr int64_t grain = WC;
  const int64_t tile = std::max<int64_t>(grain, kiln_linear::kWeightTileBytes / (K * 4) / grain * grain);
  const int64_t row_block = std::max<int64_t>(WR, kiln_linear::kRowBlockBytes / (K * 4) / WR * WR);
  const bool k_blocks = K > 2 * kWidenedKBlock;
  kiln_int4::over_widened_tiles<float>(p.codes, p.scale_min, K, p.N, p.G, tile, 4 * WC,
                                       kiln_int4::widen_row<P, float>,
                                       [&](const float* widened, int64_t t0, int64_t rows) {
    thread_local std::vector<float> acc;
    if (k_blocks) acc.resize(row_block * rows * 8);
    for (int64_t m0 = 0; m0 < M; m0 += row_block) {
      const int64_t m1 = std::min(M, m0 + row_block);
      if (k_blocks) {
        WidenedKBlocks{p.x, widened, p.y + t0, acc.data(), K, p.N, rows}.run(m0, m1, kWidenedKBlock);
      } else {
        const Dense d{p.x, widened, nullptr, p.y + t0, K, p.N};
        Kernels<Dense>::block(d, m0, m1, 0, rows);
      }
    }
  });
}
#endif

template <typename P>
void run_w4(const at::Tensor& x, const at::Tensor& codes, const P* scale_min, at::Tensor& y, int64_t group_size) {
  const Int4Problem<P> p{x.const_data_ptr<float>(), codes.const_data_ptr<uint8_t>(), scale_min,
                         y.mutable_data_ptr<float>(), codes.size(1) * 2, codes.size(0), group_size};
  if (x.size(0) > kiln_linear::kNarrowMaxRows)
#if KILN_AVX512
    kiln_lane_panels::run(p.x, p.codes, p.scale_min, p.y, x.size(0), p.N, p.K, p.G);
#else
    run_w4_tiles(p, x.size(0));
#endif
  else
    Kernels<Int4Problem<P>>::run(p, x.size(0));
}

// x fp32 [M, K] @ int4-group weights (Int4Problem's layout)^T; scale_min fp16 or fp32.
at::Tensor linear_w4(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale_min,
                     int64_t group_size) {
  const kiln_int4::Weight w = kiln_int4::checked_weight(codes, scale_min, group_size, "linear_w4");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.K, "linear_w4: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "linear_w4: fp32 CPU x required");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  w.with_params([&](const auto* params) { run_w4(x, w.codes, params, y, w.G); });
  return y;
}

// x [M, K] (fp32 or bf16) @ w bf16 [N, K]^T in fp32 arithmetic: x widened
// once, the weights in registers; y in x's dtype, rounded once.
at::Tensor linear_bf16_widen(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "linear_bf16: shape mismatch");
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "linear_bf16: bf16 weight, fp32 or bf16 x required");
  TORCH_CHECK(w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(),
              "linear_bf16: contiguous CPU weight required");
  const at::Tensor y = dense<at::BFloat16>(x.to(at::kFloat), w, nullptr);
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

}  // namespace

namespace kiln {
#ifndef KILN_AVX512_BF16
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) { return ::linear_bf16_widen(x, w); }
#endif
at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) { return ::linear_f32(x, w); }
// The builds with VNNI (avx512_vnni, avx512_bf16) quantize x in groups of
// 32 and run VNNI dot products (linear_int8_vnni.cpp: 1.3-1.5x faster,
// perplexity within 1%); the others keep fp32 activations. linear_w8_fp32x
// is the latter in every build.
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales) {
#ifdef KILN_VNNI
  return kiln::linear_w8a8(x, w, scales);
#else
  return ::linear_w8(x, w, scales);
#endif
}
// int4 keeps fp32 activations (linear_w4_fp32x is the same kernel by its
// explicit name). linear_w4a8 (int8 activations, 1.4-2.6x faster on AVX2) is
// not the default yet: a chunked prefill or a prefix-cache hit attends to
// cached keys, which differs from a whole prefill in the last bits, and
// quantizing activations grows that into other greedy tokens
// (tests/integration/llm/test_batch_invariance.py's chunked case fails with
// it). Every M takes the same kernel either way, so a row's bits do not
// depend on the other rows.
at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min, int64_t group_size) {
  return ::linear_w4(x, codes, scale_min, group_size);
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("linear_w4(Tensor x, Tensor codes, Tensor scale_min, int group_size) -> Tensor");
  m.def("linear_q8_0(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("linear_bf16(Tensor x, Tensor w) -> Tensor");
  m.def("linear_bf16_widen(Tensor x, Tensor w) -> Tensor");
  m.def("linear_w8_fp32x(Tensor x, Tensor w, Tensor scales) -> Tensor");
  m.def("linear_w4_fp32x(Tensor x, Tensor codes, Tensor scale_min, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_f32", linear_f32);
  m.impl("linear_w8", kiln::linear_w8);
  m.impl("linear_w4", kiln::linear_w4);
  m.impl("linear_q8_0", linear_q8_0);
  m.impl("linear_w4_fp32x", ::linear_w4);
  m.impl("linear_bf16_widen", linear_bf16_widen);
  m.impl("linear_w8_fp32x", ::linear_w8);
#ifndef KILN_AVX512_BF16  // else linear_bf16.cpp registers its own
  m.impl("linear_bf16", linear_bf16_widen);
#endif
}
