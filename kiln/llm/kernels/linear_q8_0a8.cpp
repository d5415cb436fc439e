// GGUF Q8_0 weights x int8 activations for CPU (AVX2; the avx512_bf16 build
// compiles the same code): y[M, N] = x[M, K] @ W^T, W as Q8_0 blocks (codes
// int8 [N, K], one fp32 scale per block of 32 along K: w = code * scale).
//
// x is quantized once per call, per row in groups of 32 (quantize_x8.h),
// which are the weight's blocks. Per block, sum(code * xq) is exact in int32:
// `vpmaddubsw` takes one unsigned operand, so it multiplies |code| by xq
// carrying code's sign (`vpsignb`), then `vpmaddwd` adds pairs. A pair is at
// most 2 * 128 * 127 = 32512 < 2^15 (codes may be -128, xq never exceeds
// 127), so nothing saturates. The eight int32 lanes are converted to fp32,
// multiplied by (scale * sx) of the block and added into an fp32 accumulator;
// at the end its lanes are summed in a fixed order. That is llama.cpp's
// Q8_0 x Q8_0 dot product up to fp32 rounding (its x scales are fp16).
//
// Every micro-kernel shape computes an output by that same chain, and x's
// quantization depends only on its row, so a row's result does not depend
// on M or on the other rows (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "kernels.h"
#include "linear_tiling.h"
#include "quantize_x8.h"
#include "simd.h"

namespace kiln_q8a8 {
namespace {

using kiln_x8::kGroup;

struct Q8A8Problem {
  static constexpr int kWideRows = 4, kWideCols = 3, kSingleRowCols = 4;
  const int8_t* xq;       // [M, K]
  const float* x_scale;   // [M, K / 32]
  const int8_t* codes;    // [N, K]
  const float* w_scale;   // [N, K / 32]
  float* y;
  int64_t K, N;

  int64_t row_bytes() const { return K; }
  int64_t x_row_bytes() const { return K + K / kGroup * 4; }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const int64_t blocks = K / kGroup;
    const int8_t* __restrict xr = xq + m0 * K;
    const float* __restrict xs = x_scale + m0 * blocks;
    const int8_t* __restrict wr = codes + n0 * K;
    const float* __restrict ws = w_scale + n0 * blocks;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k = b * kGroup;
      if (b % 2 == 0)  // the next rows, a line at a time (see linear_f32.cpp's DenseProblem)
        kiln_linear::prefetch_ahead<NR>(wr, K, k);
      __m256i w[NR], w_abs[NR];
      for (int n = 0; n < NR; ++n) {
        w[n] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr + n * K + k));
        w_abs[n] = _mm256_abs_epi8(w[n]);
      }
      for (int m = 0; m < MR; ++m) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + m * K + k));
        for (int n = 0; n < NR; ++n) {
          const __m256i pairs = _mm256_maddubs_epi16(w_abs[n], _mm256_sign_epi8(x, w[n]));
          const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
          const __m256 scale = _mm256_set1_ps(ws[n * blocks + b] * xs[m * blocks + b]);
          acc[m][n] = _mm256_fmadd_ps(dot, scale, acc[m][n]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = kiln_simd::hsum(acc[m][n]);
  }
};

// x fp32 [M, K] -> xq int8 [M, K] and x_scale [M, K / 32].
void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* x_scale) {
  const int64_t blocks = K / kGroup;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    int32_t q[kGroup];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < blocks; ++b) {
        x_scale[m * blocks + b] = kiln_x8::quantize_group(x + m * K + b * kGroup, q).scale;
        for (int64_t i = 0; i < kGroup; ++i) xq[m * K + b * kGroup + i] = static_cast<int8_t>(q[i]);
      }
  });
}

}  // namespace
}  // namespace kiln_q8a8

namespace kiln {
// x fp32 [M, K] @ (Q8_0 blocks: codes int8 [N, K] * scales fp32 [N, K / 32])^T, x quantized to int8
// in the same blocks (see above).
at::Tensor linear_q8_0a8(const at::Tensor& x_in, const at::Tensor& codes_in, const at::Tensor& scales_in) {
  TORCH_CHECK(codes_in.dim() == 2 && codes_in.scalar_type() == at::kChar, "linear_q8_0a8: int8 codes [N, K] required");
  const int64_t N = codes_in.size(0), K = codes_in.size(1);
  TORCH_CHECK(K % kiln_x8::kGroup == 0, "linear_q8_0a8: K must be a multiple of 32");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == K, "linear_q8_0a8: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu() && codes_in.device().is_cpu(),
              "linear_q8_0a8: fp32 CPU x required");
  TORCH_CHECK(scales_in.scalar_type() == at::kFloat && scales_in.device().is_cpu() &&
                  scales_in.numel() == N * (K / kiln_x8::kGroup),
              "linear_q8_0a8: fp32 scales [N, K / 32] required");
  const at::Tensor x = x_in.contiguous(), codes = codes_in.contiguous(), scales = scales_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor x_scale = at::empty({M, K / kiln_x8::kGroup}, x.options());
  kiln_q8a8::quantize_rows(x.const_data_ptr<float>(), M, K, xq.mutable_data_ptr<int8_t>(),
                           x_scale.mutable_data_ptr<float>());
  at::Tensor y = at::empty({M, N}, x.options());
  const kiln_q8a8::Q8A8Problem p{xq.const_data_ptr<int8_t>(), x_scale.const_data_ptr<float>(),
                                 codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                                 y.mutable_data_ptr<float>(), K, N};
  kiln_linear::Kernels<kiln_q8a8::Q8A8Problem>::run(p, M);
  return y;
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("linear_q8_0a8(Tensor x, Tensor codes, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_q8_0a8", kiln::linear_q8_0a8); }
