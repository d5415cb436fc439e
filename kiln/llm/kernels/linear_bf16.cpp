// bf16 linear with AVX512_BF16 dot products (the avx512_bf16 build only):
// y[M, N] = x[M, K] @ w[N, K]^T, w bf16 as stored, x bf16 (an fp32 x is
// rounded to bf16 once, up front, as torch's bf16 matmul would see it),
// fp32 accumulation, y in x's dtype rounded once.
//
// `vdpbf16ps` takes 32 bf16 pairs of x and w and adds the two products of
// each pair into one of 16 fp32 lanes: twice the multiply-adds of an fp32
// FMA per instruction, from half the bytes. Every output is one chain of
// these over K in runs of 32 (the K tail through masked loads, zeros
// beyond), then the 16 lanes summed in a fixed order. Every micro-kernel
// shape computes an output by that same chain, so a row's result does not
// depend on M or on the other rows (batch invariance); tiling and threads
// as the fp32 kernel (linear_tiling.h):
// - M <= 8: all rows against one w row, each weight leaves memory once
//   (for M = 1 too: one sequential stream reads fastest);
// - M > 8: 4 x rows by 4 w rows, 16 accumulators, 8 loads per 16 dot products.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "kernels.h"
#include "linear_tiling.h"
#include "simd512.h"

namespace {

using kiln_linear::kPrefetchPasses;
using kiln_simd512::reduce16;

inline __m512bh load32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load32(const uint16_t* p, __mmask32 keep) { return (__m512bh)_mm512_maskz_loadu_epi16(keep, p); }

// Weight rows per pass for a single x row: one (a single sequential stream)
// read 1.6x faster than four on Zen 4 (docs/benchmarks.md). A macro for tuning.
#ifndef KILN_BF16_SINGLE_ROW_COLS
#define KILN_BF16_SINGLE_ROW_COLS 1
#endif
#ifndef KILN_BF16_WIDE_ROWS
#define KILN_BF16_WIDE_ROWS 4
#define KILN_BF16_WIDE_COLS 4
#endif

template <typename Out>  // float or c10::BFloat16
struct Bf16DotProblem {
  static constexpr int kWideRows = KILN_BF16_WIDE_ROWS, kWideCols = KILN_BF16_WIDE_COLS;
  static constexpr int kSingleRowCols = KILN_BF16_SINGLE_ROW_COLS;
  const uint16_t* x;  // bf16 bits [M, K]
  const uint16_t* w;  // bf16 bits [N, K]
  Out* y;
  int64_t K, N;

  int64_t row_bytes() const { return K * 2; }
  int64_t x_row_bytes() const { return K * 2; }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const uint16_t* __restrict xr = x + m0 * K;
    const uint16_t* __restrict wr = w + n0 * K;
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
      // 32 bf16 are one cache line: request the same line of the next rows.
      for (int n = 0; n < NR; ++n)
        _mm_prefetch(reinterpret_cast<const char*>(wr + (kPrefetchPasses * NR + n) * K + k), _MM_HINT_T0);
      __m512bh wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = load32(wr + n * K + k);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = load32(xr + m * K + k);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
      }
    }
    if (k < K) {
      const __mmask32 keep = _cvtu32_mask32((1u << (K - k)) - 1);
      __m512bh wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = load32(wr + n * K + k, keep);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = load32(xr + m * K + k, keep);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = static_cast<Out>(reduce16(acc[m][n]));
  }
};

template <typename Out>
void run_bf16(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  const Bf16DotProblem<Out> p{reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()),
                              reinterpret_cast<const uint16_t*>(w.const_data_ptr<at::BFloat16>()),
                              y.mutable_data_ptr<Out>(), x.size(1), w.size(0)};
  kiln_linear::Kernels<Bf16DotProblem<Out>>::run(p, x.size(0));
}

at::Tensor linear_bf16(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_bf16: shape mismatch");
  const at::ScalarType out_dtype = x_in.scalar_type();
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && (out_dtype == at::kFloat || out_dtype == at::kBFloat16),
              "linear_bf16: bf16 weight, fp32 or bf16 x required");
  TORCH_CHECK(w.is_contiguous() && x_in.device().is_cpu() && w.device().is_cpu(),
              "linear_bf16: contiguous CPU weight required");
  const at::Tensor x = x_in.to(at::kBFloat16).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, x_in.options());
  if (out_dtype == at::kFloat) run_bf16<float>(x, w, y);
  else run_bf16<c10::BFloat16>(x, w, y);
  return y;
}

}  // namespace

namespace kiln {
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) { return ::linear_bf16(x, w); }
}  // namespace kiln

TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_bf16", linear_bf16); }
