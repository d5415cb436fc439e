// fp32 linear for CPU: y[M,N] = x[M,K] @ w[N,K]^T, weights as stored (no repacking).
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

// y[m, n] for m < MR, n < NR; x rows are K apart, w rows K apart, y rows ldy.
template <int MR, int NR>
void micro(const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t K, int64_t ldy) {
  __m256 acc[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256 wv[NR];
    for (int n = 0; n < NR; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int m = 0; m < MR; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_fmadd_ps(xv, wv[n], acc[m][n]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int n = 0; n < NR; ++n) {
      float s = hsum(acc[m][n]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * w[n * K + t];
      y[m * ldy + n] = s;
    }
}

using MicroFn = void (*)(const float*, const float*, float*, int64_t, int64_t);
// kNarrow[m]: m rows against one w row. kWide[m][n]: m <= 4 rows by n <= 3 w rows.
constexpr MicroFn kNarrow[9] = {nullptr,      micro<1, 1>, micro<2, 1>, micro<3, 1>, micro<4, 1>,
                                micro<5, 1>, micro<6, 1>, micro<7, 1>, micro<8, 1>};
constexpr MicroFn kWide[5][4] = {{nullptr},
                                 {nullptr, micro<1, 1>, micro<1, 2>, micro<1, 3>},
                                 {nullptr, micro<2, 1>, micro<2, 2>, micro<2, 3>},
                                 {nullptr, micro<3, 1>, micro<3, 2>, micro<3, 3>},
                                 {nullptr, micro<4, 1>, micro<4, 2>, micro<4, 3>}};
constexpr int64_t kNarrowMaxRows = 8, kWideRows = 4, kWideCols = 3;
constexpr int64_t kWeightTileBytes = 64 * 1024, kRowBlockBytes = 256 * 1024;

// Rows [m0, m1) against w rows [n0, n1).
void block(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t m0, int64_t m1, int64_t n0,
           int64_t n1) {
  if (m1 - m0 == 1) {  // one FMA chain per w row is latency-bound: take 4 w rows per pass
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) micro<1, 4>(x + m0 * K, w + n * K, y + m0 * N + n, K, N);
    for (; n < n1; ++n) micro<1, 1>(x + m0 * K, w + n * K, y + m0 * N + n, K, N);
    return;
  }
  if (m1 - m0 <= kNarrowMaxRows) {
    const MicroFn fn = kNarrow[m1 - m0];
    for (int64_t n = n0; n < n1; ++n) fn(x + m0 * K, w + n * K, y + m0 * N + n, K, N);
    return;
  }
  for (int64_t m = m0; m < m1; m += kWideRows) {
    const int64_t mr = std::min(kWideRows, m1 - m);
    for (int64_t n = n0; n < n1; n += kWideCols) {
      const int64_t nr = std::min(kWideCols, n1 - n);
      kWide[mr][nr](x + m * K, w + n * K, y + m * N + n, K, N);
    }
  }
}

at::Tensor linear_f32(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_f32: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "linear_f32: float32 only");
  TORCH_CHECK(w.is_contiguous() && x_in.device().is_cpu(), "linear_f32: contiguous CPU weight required");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const int64_t row_bytes = K * static_cast<int64_t>(sizeof(float));
  const int64_t tile = std::max<int64_t>(kWideCols, kWeightTileBytes / row_bytes / kWideCols * kWideCols);
  // A row block is a multiple of the wide kernel's rows, or all of a small M.
  const int64_t rows = M <= kNarrowMaxRows
                           ? M
                           : std::max<int64_t>(kWideRows, kRowBlockBytes / row_bytes / kWideRows * kWideRows);
  at::parallel_for(0, N, 4 * kWideCols, [&](int64_t n_begin, int64_t n_end) {
    for (int64_t m0 = 0; m0 < M; m0 += rows) {
      const int64_t m1 = std::min(M, m0 + rows);
      for (int64_t t0 = n_begin; t0 < n_end; t0 += tile)
        block(xp, wp, yp, K, N, m0, m1, t0, std::min(n_end, t0 + tile));
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("linear_f32(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_f32", linear_f32); }
