// int8 linear with AVX512_VNNI (the avx512_vnni and avx512_bf16 builds):
// y[M, N] = x[M, K] @ (w int8 [N, K] * scale[N])^T with x quantized
// dynamically to int8 in groups of 32 along K: for each row and group,
// sx = max|x| / 127 and xq = round(x / sx). (One scale per row cost SmolLM2
// 3-5% perplexity; groups of 32 keep it within 0.1% of weight-only int8,
// docs/benchmarks.md.)
//
// `vpdpbusd` multiplies 64 unsigned bytes by 64 signed bytes and adds each
// group of four products into one of 16 int32 lanes: 64 multiply-adds per
// instruction from bytes as stored, so a decode step reads int8 weights at
// memory speed instead of widening each to fp32. It takes one operand
// unsigned: x is stored as xq + 128 (1..255), and the 128 * sum(w) this adds
// is taken off again, that sum computed by the same instruction on ones.
//
// Per 64-wide run of K: the exact int32 dot products (lanes 0-7 cover one
// group of 32, lanes 8-15 the next) are scaled by their groups' sx in fp32
// and added into an fp32 accumulator per output; at the end its 16 lanes are
// summed in a fixed tree and scaled by w's row scale. Every micro-kernel
// shape computes an output by that same chain, so a row's result depends
// only on that row (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#include "kernels.h"
#include "linear_tiling.h"
#include "simd512.h"

namespace {

using kiln_simd512::reduce16;

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }
inline __m512i load64(const void* p, __mmask64 keep) { return _mm512_maskz_loadu_epi8(keep, p); }

constexpr int64_t kGroup = 32;  // x values per scale

struct W8A8Problem {
  static constexpr int kWideRows = 4, kWideCols = 4, kSingleRowCols = 1;
  const uint8_t* xq;         // [M, K]: round(x / sx) + 128
  const float* lane_scale;   // [M, L]: sx of the group each int32 lane (4 values of K) falls in
  const int8_t* w;           // [N, K]
  const float* w_scale;      // [N]
  float* y;
  int64_t K, N, L;           // L = 16 * ceil(K / 64)

  int64_t row_bytes() const { return K; }
  int64_t x_row_bytes() const { return K + 4 * L; }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const uint8_t* __restrict xr = xq + m0 * K;
    const float* __restrict sr = lane_scale + m0 * L;
    const int8_t* __restrict wr = w + n0 * K;
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    auto run = [&](int64_t k, auto load) {
      __m512i wv[NR], offset[NR];
      for (int n = 0; n < NR; ++n) {
        wv[n] = load(wr + n * K + k);
        offset[n] = _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, wv[n]), 7);
      }
      for (int m = 0; m < MR; ++m) {
        const __m512i xv = load(xr + m * K + k);
        const __m512 sv = _mm512_loadu_ps(sr + m * L + k / 4);
        for (int n = 0; n < NR; ++n) {
          const __m512i dot = _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), xv, wv[n]), offset[n]);
          acc[m][n] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sv, acc[m][n]);
        }
      }
    };
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      kiln_linear::prefetch_ahead<NR>(wr, K, k);  // one cache line per row: a line of the next rows
      run(k, [](const auto* p) { return load64(p); });
    }
    if (k < K) {
      const __mmask64 keep = _cvtu64_mask64((~uint64_t{0}) >> (64 - (K - k)));
      run(k, [keep](const auto* p) { return load64(p, keep); });
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = reduce16(acc[m][n]) * w_scale[n0 + n];
  }
};

// Row m of x -> round(x / sx) + 128 as bytes, sx = max|x| / 127 per group of
// 32 (1 for a zero group), and each group's sx repeated for its 8 int32 lanes.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t L, uint8_t* xq, float* lane_scale) {
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* row = x + m * K;
      uint8_t* out = xq + m * K;
      float* lanes = lane_scale + m * L;
      std::fill(lanes, lanes + L, 0.0f);
      for (int64_t g = 0; g < K; g += kGroup) {
        const int64_t n = std::min(kGroup, K - g);
        const __mmask16 lo = _cvtu32_mask16(n >= 16 ? 0xffff : (1u << n) - 1);
        const __mmask16 hi = _cvtu32_mask16(n >= 32 ? 0xffff : n > 16 ? (1u << (n - 16)) - 1 : 0);
        const __m512 a = _mm512_maskz_loadu_ps(lo, row + g), b = _mm512_maskz_loadu_ps(hi, row + g + 16);
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        std::fill(lanes + g / 4, lanes + g / 4 + kGroup / 4, amax > 0.0f ? amax / 127.0f : 1.0f);
        // round to nearest even, as torch.round; |q| <= 127, + 128 by flipping the sign bit
        const __m512 vinv = _mm512_set1_ps(inv);
        const __m128i bias = _mm_set1_epi8(static_cast<char>(0x80));
        const __m128i qa = _mm_xor_si128(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, vinv))), bias);
        const __m128i qb = _mm_xor_si128(_mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, vinv))), bias);
        _mm_mask_storeu_epi8(out + g, lo, qa);
        _mm_mask_storeu_epi8(out + g + 16, hi, qb);
      }
    }
  });
}

}  // namespace

namespace kiln {
// x fp32 [M, K] @ (w int8 [N, K] * scales fp32 [N])^T, x quantized in groups of 32 to int8 (see above).
at::Tensor linear_w8a8(const at::Tensor& x_in, const at::Tensor& w, const at::Tensor& scales_in) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "linear_w8a8: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, "linear_w8a8: fp32 x, int8 w");
  TORCH_CHECK(w.is_contiguous() && x_in.device().is_cpu() && w.device().is_cpu(),
              "linear_w8a8: contiguous CPU weight required");
  const at::Tensor scales = scales_in.contiguous();
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == w.size(0), "linear_w8a8: fp32 scales [N]");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0), L = 16 * ((K + 63) / 64);
  at::Tensor xq = at::empty({M, K}, x.options().dtype(at::kByte));
  at::Tensor lane_scale = at::empty({M, L}, x.options());
  quantize_rows(x.const_data_ptr<float>(), M, K, L, xq.mutable_data_ptr<uint8_t>(),
                lane_scale.mutable_data_ptr<float>());
  at::Tensor y = at::empty({M, N}, x.options());
  const W8A8Problem p{xq.const_data_ptr<uint8_t>(), lane_scale.const_data_ptr<float>(), w.const_data_ptr<int8_t>(),
                      scales.const_data_ptr<float>(), y.mutable_data_ptr<float>(), K, N, L};
  kiln_linear::Kernels<W8A8Problem>::run(p, M);
  return y;
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("linear_w8a8(Tensor x, Tensor w, Tensor scales) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_w8a8", kiln::linear_w8a8); }
