// fp32-activation linear for CPU: y[M,N] = x[M,K] @ w[N,K]^T, weights as
// stored (no repacking): fp32, or int8 with a per-row scale (weight-only
// quantization; the int8 values are widened in registers, never in memory).
//
// Every output is a dot product of an x row and a w row, accumulated along K
// eight lanes at a time, then summed across lanes and the K tail in a fixed
// order. Which micro-kernel computes it (how many x rows and w rows share a
// pass) changes only the speed, never the bits: a row's result does not
// depend on M or on the other rows (batch invariance).
//
// Micro-kernel shapes:
// - M <= 8 (decode, speculative verification): all rows against one w row
//   (four w rows for M = 1, for enough independent FMA chains), so each
//   weight row leaves memory once; the step is bandwidth-bound.
// - M > 8: 4 x rows by 3 w rows, 12 accumulators in registers, 7 loads per
//   12 FMAs; the step is compute-bound.
// Weight rows are taken in tiles that stay in L2 while every group of x rows
// passes over them; x is taken in L2-sized row blocks. Threads split N.
//
// Built with -fopenmp: ATen's parallel_for is a header template that runs
// serially when the including file is compiled without OpenMP.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd.h"

namespace {

using kiln_simd::hsum;

// Eight weights as floats: fp32 as stored, int8 widened (its per-row scale is
// applied once to the finished dot product).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// y[m, n] for m < MR, n < NR; x rows are K apart, w rows K apart, y rows ldy;
// scale: per-w-row factors (int8 weights) or nullptr.
template <typename W, int MR, int NR>
void micro(const float* __restrict x, const W* __restrict w, const float* scale, float* __restrict y, int64_t K,
           int64_t ldy) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    // The next NR weight rows follow these in memory: request them a line at
    // a time while these are computed (the hardware prefetcher alone falls
    // behind on int8 rows, which take a quarter of fp32's compute per line).
    if ((k * sizeof(W)) % 64 == 0)
      for (int n = 0; n < NR; ++n) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + n) * K + k), _MM_HINT_T0);
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = load8(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * static_cast<float>(w[n * K + t]);
      y[m * ldy + n] = scale ? s * scale[n] : s;
    }
}

constexpr int64_t kNarrowMaxRows = 8, kWideRows = 4, kWideCols = 3;
constexpr int64_t kWeightTileBytes = 64 * 1024, kRowBlockBytes = 256 * 1024;

template <typename W>
struct Kernels {
  using Fn = void (*)(const float*, const W*, const float*, float*, int64_t, int64_t);
  // narrow[m]: m rows against one w row. wide[m][n]: m <= 4 rows by n <= 3 w rows.
  static constexpr Fn narrow[9] = {nullptr,          micro<W, 1, 1>, micro<W, 2, 1>,
                                   micro<W, 3, 1>, micro<W, 4, 1>, micro<W, 5, 1>,
                                   micro<W, 6, 1>, micro<W, 7, 1>, micro<W, 8, 1>};
  static constexpr Fn wide[5][4] = {{nullptr},
                                    {nullptr, micro<W, 1, 1>, micro<W, 1, 2>, micro<W, 1, 3>},
                                    {nullptr, micro<W, 2, 1>, micro<W, 2, 2>, micro<W, 2, 3>},
                                    {nullptr, micro<W, 3, 1>, micro<W, 3, 2>, micro<W, 3, 3>},
                                    {nullptr, micro<W, 4, 1>, micro<W, 4, 2>, micro<W, 4, 3>}};

  // Rows [m0, m1) against w rows [n0, n1).
  static void block(const float* x, const W* w, const float* scale, float* y, int64_t K, int64_t N, int64_t m0,
                    int64_t m1, int64_t n0, int64_t n1) {
    auto at = [scale](int64_t n) { return scale ? scale + n : nullptr; };
    if (m1 - m0 == 1) {  // one FMA chain per w row is latency-bound: take 4 w rows per pass
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4) micro<W, 1, 4>(x + m0 * K, w + n * K, at(n), y + m0 * N + n, K, N);
      for (; n < n1; ++n) micro<W, 1, 1>(x + m0 * K, w + n * K, at(n), y + m0 * N + n, K, N);
      return;
    }
    if (m1 - m0 <= kNarrowMaxRows) {
      const Fn fn = narrow[m1 - m0];
      for (int64_t n = n0; n < n1; ++n) fn(x + m0 * K, w + n * K, at(n), y + m0 * N + n, K, N);
      return;
    }
    for (int64_t m = m0; m < m1; m += kWideRows) {
      const int64_t mr = std::min(kWideRows, m1 - m);
      for (int64_t n = n0; n < n1; n += kWideCols) {
        const int64_t nr = std::min(kWideCols, n1 - n);
        wide[mr][nr](x + m * K, w + n * K, at(n), y + m * N + n, K, N);
      }
    }
  }

  static at::Tensor run(const at::Tensor& x_in, const at::Tensor& w, const float* scale) {
    const at::Tensor x = x_in.contiguous();
    const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
    at::Tensor y = at::empty({M, N}, x.options());
    const float* xp = x.const_data_ptr<float>();
    const W* wp = w.const_data_ptr<W>();
    float* yp = y.mutable_data_ptr<float>();
    const int64_t row_bytes = K * static_cast<int64_t>(sizeof(W)), x_row_bytes = K * 4;
    const int64_t tile = std::max<int64_t>(kWideCols, kWeightTileBytes / row_bytes / kWideCols * kWideCols);
    // A row block is a multiple of the wide kernel's rows, or all of a small M.
    const int64_t rows = M <= kNarrowMaxRows
                             ? M
                             : std::max<int64_t>(kWideRows, kRowBlockBytes / x_row_bytes / kWideRows * kWideRows);
    at::parallel_for(0, N, 4 * kWideCols, [&](int64_t n_begin, int64_t n_end) {
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m1 = std::min(M, m0 + rows);
        for (int64_t t0 = n_begin; t0 < n_end; t0 += tile)
          block(xp, wp, scale, yp, K, N, m0, m1, t0, std::min(n_end, t0 + tile));
      }
    });
    return y;
  }
};

void check_operands(const at::Tensor& x, const at::Tensor& w, at::ScalarType wtype, const char* name) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), name, ": shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == wtype, name, ": operand dtypes");
  TORCH_CHECK(w.is_contiguous() && x.device().is_cpu() && w.device().is_cpu(), name, ": contiguous CPU weight required");
}

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w) {
  check_operands(x, w, at::kFloat, "linear_f32");
  return Kernels<float>::run(x, w, nullptr);
}

// x fp32 [M, K] @ (w int8 [N, K] * scales fp32 [N])^T, activations kept in fp32.
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales_in) {
  check_operands(x, w, at::kChar, "linear_w8");
  const at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0), "linear_w8: fp32 scales [N] required");
  return Kernels<int8_t>::run(x, w, scales.const_data_ptr<float>());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_f32(Tensor x, Tensor w) -> Tensor");
  m.def("linear_w8(Tensor x, Tensor w, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_f32", linear_f32);
  m.impl("linear_w8", linear_w8);
}
