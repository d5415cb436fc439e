// int4 group-wise weights (linear_f32.cpp's Int4Problem layout) times a
// prompt-sized fp32 x: y[M, N] = x[M, K] @ W^T, for the rows where the int4
// kernel's dot products (linear_w4) are compute-bound at ~100-140 GFLOP/s.
//
// Threads split W into panels of 16 rows. Each panel is widened once per call
// (int4_widen.h's widen_row: the weights linear_w4 multiplies by) and laid
// out k-major, panel[k][16], then every x row passes over it in a 6 x 16
// outer-product micro-kernel: per k, two panel vectors, six broadcasts of x
// and twelve FMAs, the accumulators never summed across lanes. K is taken in
// blocks of kKBlock so that a panel's block (16 KiB) stays in L1 while the x
// rows stream by; between blocks the accumulators go through y (or a scratch)
// and come back.
//
// Every output is one chain, y[m, n] = fma(x[m, k], w[n, k], y) for k = 0, 1,
// ... K-1 from 0, in fp32: storing and reloading an fp32 accumulator is exact,
// and the chain is the same for every micro-kernel shape, so a row's result
// depends on neither M nor the other rows (batch invariance), but is not the
// int4 kernel's (eight partial sums per output added at the end), as oneDNN's
// GEMM on the widened weight, which this replaces, was not either.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "int4_widen.h"

namespace {

constexpr int64_t kPanel = 16;   // weight rows per panel: two AVX2 vectors of outputs
constexpr int64_t kRows = 6;     // x rows per micro-kernel pass: 6 x 2 accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t kKBlock = 256; // a panel's block: 256 x 16 floats = 16 KiB
constexpr int64_t kMBlock = 240; // x rows per block, a multiple of kRows

// c[m, 0 .. 16] (row stride ldc) for the six x rows m (row stride K) over k
// in [k0, k1): the accumulators start at 0 (kFirst) or at c, and end in c.
// Twelve named accumulators: GCC kept an array of them on the stack,
// storing each after every FMA (62 GFLOP/s instead of ~170).
template <bool kFirst>
void micro(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* c, int64_t ldc) {
#define KILN_ACC_INIT(m)                                                     \
  __m256 lo##m = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (m) * ldc), \
         hi##m = kFirst ? _mm256_setzero_ps() : _mm256_loadu_ps(c + (m) * ldc + 8);
#define KILN_ACC_FMA(m)                                        \
  {                                                            \
    const __m256 xv = _mm256_broadcast_ss(x + (m) * K + k);    \
    lo##m = _mm256_fmadd_ps(xv, w0, lo##m);                    \
    hi##m = _mm256_fmadd_ps(xv, w1, hi##m);                    \
  }
#define KILN_ACC_STORE(m)                       \
  _mm256_storeu_ps(c + (m) * ldc, lo##m);       \
  _mm256_storeu_ps(c + (m) * ldc + 8, hi##m);
  KILN_ACC_INIT(0) KILN_ACC_INIT(1) KILN_ACC_INIT(2) KILN_ACC_INIT(3) KILN_ACC_INIT(4) KILN_ACC_INIT(5)
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 w0 = _mm256_load_ps(panel + k * kPanel), w1 = _mm256_load_ps(panel + k * kPanel + 8);
    KILN_ACC_FMA(0) KILN_ACC_FMA(1) KILN_ACC_FMA(2) KILN_ACC_FMA(3) KILN_ACC_FMA(4) KILN_ACC_FMA(5)
  }
  KILN_ACC_STORE(0) KILN_ACC_STORE(1) KILN_ACC_STORE(2) KILN_ACC_STORE(3) KILN_ACC_STORE(4) KILN_ACC_STORE(5)
#undef KILN_ACC_INIT
#undef KILN_ACC_FMA
#undef KILN_ACC_STORE
}

// Rows [n0, n0 + cols) of W widened and laid out k-major into `panel` (K x 16,
// rows past `cols` zero); `rows` is scratch for the row-major widening.
template <typename P>
void widen_panel(const kiln_int4::Weight& w, const P* params, int64_t n0, int64_t cols, std::vector<float>& rows,
                 float* panel) {
  const int64_t K = w.K, groups = K / w.G;
  const uint8_t* codes = w.codes.const_data_ptr<uint8_t>();
  if (cols < kPanel) std::fill(rows.begin() + cols * K, rows.end(), 0.0f);
  for (int64_t j = 0; j < cols; ++j)
    kiln_int4::widen_row(codes + (n0 + j) * (K / 2), params + (n0 + j) * groups * 2, rows.data() + j * K, K, w.G);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t j = 0; j < kPanel; ++j) panel[k * kPanel + j] = rows[j * K + k];
}

// x rows are taken kMBlock at a time (a k-block of them, 240 KiB at
// kKBlock, stays in L2 while the thread's panels pass over it; each panel is
// widened again for each row block). A panel's outputs go straight to y, or
// for the last panel of an N that is not a multiple of 16 through a
// [rows, 16] scratch whose first columns are copied out. The block's last
// rows % 6 run through six-row scratch copies (zero rows past its end; each
// row's chain is its own, so the padding changes no output).
template <typename P>
void run(const float* x, const kiln_int4::Weight& w, const P* params, float* y, int64_t M) {
  const int64_t K = w.K, N = w.N, panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(kPanel * K), scratch(kMBlock * kPanel), x_tail(kRows * K), c_tail(kRows * kPanel);
    float* panel = static_cast<float*>(std::aligned_alloc(64, kPanel * K * sizeof(float)));
    for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
      const int64_t m1 = std::min(M, m0 + kMBlock), full = m0 + (m1 - m0) / kRows * kRows;
      std::fill(x_tail.begin(), x_tail.end(), 0.0f);
      std::copy(x + full * K, x + m1 * K, x_tail.begin());
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        widen_panel(w, params, n0, cols, rows, panel);
        float* c = cols < kPanel ? scratch.data() : y + m0 * N + n0;  // row m0 + i at c + i * ldc
        const int64_t ldc = cols < kPanel ? kPanel : N;
        for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
          const int64_t k1 = std::min(K, k0 + kKBlock);
          const auto fn = k0 == 0 ? micro<true> : micro<false>;
          for (int64_t m = m0; m < full; m += kRows) fn(x + m * K, K, panel, k0, k1, c + (m - m0) * ldc, ldc);
          if (full < m1) fn(x_tail.data(), K, panel, k0, k1, c_tail.data(), kPanel);
        }
        for (int64_t m = full; m < m1; ++m)
          std::copy(c_tail.data() + (m - full) * kPanel, c_tail.data() + (m - full + 1) * kPanel, c + (m - m0) * ldc);
        if (cols < kPanel)
          for (int64_t m = m0; m < m1; ++m)
            std::copy(c + (m - m0) * kPanel, c + (m - m0) * kPanel + cols, y + m * N + n0);
      }
    }
    std::free(panel);
  });
}

// x fp32 [M, K] @ int4-group weights (Int4Problem's layout)^T; scale_min fp16 or fp32.
at::Tensor linear_w4_panels(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale_min,
                            int64_t group_size) {
  const kiln_int4::Weight w = kiln_int4::checked_weight(codes, scale_min, group_size, "linear_w4_panels");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.K, "linear_w4_panels: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "linear_w4_panels: fp32 CPU x required");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  w.with_params([&](const auto* params) {
    run(x.const_data_ptr<float>(), w, params, y.mutable_data_ptr<float>(), x.size(0));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_w4_panels(Tensor x, Tensor codes, Tensor scale_min, int group_size) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_w4_panels", linear_w4_panels); }
