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
// - M > 8: 8 x rows by 3 w rows, 24 of the 32 zmm registers accumulating,
//   11 loads per 24 dot products (4 x 4 measured 3-5% slower at 64 and 96
//   rows on Zen 4, 5 x 5 and 4 x 6 no better, 6 x 4 between).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <type_traits>

#include "int4_widen.h"
#include "int4_widen_bf16.h"
#include "kernels.h"
#include "linear_tiling.h"
#include "simd512.h"

namespace {

using kiln_int4::Int4ToBf16;
using kiln_simd512::reduce16;

inline __m512bh load32(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
inline __m512bh load32(const uint16_t* p, __mmask32 keep) { return (__m512bh)_mm512_maskz_loadu_epi16(keep, p); }

// Weight rows per pass for a single x row: one (a single sequential stream)
// read 1.6x faster than four on Zen 4 (docs/benchmarks.md). A macro for tuning.
#ifndef KILN_BF16_SINGLE_ROW_COLS
#define KILN_BF16_SINGLE_ROW_COLS 1
#endif
// Weight rows per pass of the int4 kernel for a single x row (independent dot-product chains).
#ifndef KILN_W4_BF16_SINGLE_ROW_COLS
#define KILN_W4_BF16_SINGLE_ROW_COLS 4
#endif
// Weight rows per pass of the Q8_0 kernel for a single x row: one, as linear_bf16 (LM head
// 49152 x 576, 2 threads, Zen 4: 1.03 ms against 1.15 / 1.26 / 1.15 for 2 / 4 / 8).
#ifndef KILN_Q8_0_BF16_SINGLE_ROW_COLS
#define KILN_Q8_0_BF16_SINGLE_ROW_COLS 1
#endif
#ifndef KILN_BF16_WIDE_ROWS
#define KILN_BF16_WIDE_ROWS 8
#define KILN_BF16_WIDE_COLS 3
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
      // 32 bf16 are one cache line: request a line of the next rows. One x
      // row: into L2, not L1 (Zen 4, SmolLM2's 120 projections, 2 threads, one
      // process: 1.02-1.08x over six alternated runs; the Q8_0 head below ran
      // 1.07-1.1x slower so and keeps L1).
      if constexpr (MR == 1)
        kiln_linear::prefetch_ahead<NR, _MM_HINT_T1>(wr, 2 * K, 2 * k);
      else
        kiln_linear::prefetch_ahead<NR>(wr, 2 * K, 2 * k);
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

// GGUF Q8_0 weights (int8 codes, one fp32 scale per block of 32 along K)
// against bf16 x: each block widened in registers to q * d (exact in fp32:
// an int8 times an fp16) and rounded to bf16 as `.to(torch.bfloat16)` rounds
// it, then Bf16DotProblem's chain. So the result is linear_bf16's on the
// head a bf16 model holds (the dequantized Q8_0 table in bf16), bit for bit,
// from 1.06 bytes a weight instead of 2 (the LM head of a bf16 model keeps
// the stored blocks: quant/q8_0_head.py). K a multiple of 32.
template <typename Out>
struct Q80Bf16Problem {
  static constexpr int kWideRows = KILN_BF16_WIDE_ROWS, kWideCols = KILN_BF16_WIDE_COLS;
  static constexpr int kSingleRowCols = KILN_Q8_0_BF16_SINGLE_ROW_COLS;
  const uint16_t* x;     // bf16 bits [M, K]
  const int8_t* codes;   // [N, K]
  const float* scales;   // [N, K / 32]
  Out* y;
  int64_t K, N;

  int64_t row_bytes() const { return K; }
  int64_t x_row_bytes() const { return K * 2; }

  static __m512bh widen(const int8_t* block, float scale) {
    const __m512 d = _mm512_set1_ps(scale);
    const __m128i* q = reinterpret_cast<const __m128i*>(block);
    const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), d);
    const __m512 hi = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), d);
    return _mm512_cvtne2ps_pbh(hi, lo);
  }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const uint16_t* __restrict xr = x + m0 * K;
    const int8_t* __restrict wr = codes + n0 * K;
    const float* __restrict sr = scales + n0 * (K / 32);
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      if (k % 64 == 0)  // one cache line of codes: request a line of the next rows
        kiln_linear::prefetch_ahead<NR>(wr, K, k);
      __m512bh wv[NR];
      for (int n = 0; n < NR; ++n) wv[n] = widen(wr + n * K + k, sr[n * (K / 32) + k / 32]);
      for (int m = 0; m < MR; ++m) {
        const __m512bh xv = load32(xr + m * K + k);
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

// x bf16 [M, K] @ (codes int8 [N, K] * scales fp32 [N, K/32])^T -> bf16 (Q80Bf16Problem).
at::Tensor linear_q8_0_bf16(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_q8_0_bf16: bf16 CPU x [M, K] required");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous() &&
                  codes.size(1) == x_in.size(1) && codes.size(1) % 32 == 0,
              "linear_q8_0_bf16: contiguous int8 codes [N, K], K a multiple of 32, required");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.numel() == codes.size(0) * (codes.size(1) / 32),
              "linear_q8_0_bf16: contiguous fp32 scales [N, K/32] required");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), codes.size(0)}, x.options());
  const Q80Bf16Problem<c10::BFloat16> p{reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>()),
                                        codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                                        y.mutable_data_ptr<c10::BFloat16>(), x.size(1), codes.size(0)};
  kiln_linear::Kernels<Q80Bf16Problem<c10::BFloat16>>::run(p, x.size(0));
  return y;
}

// int4 group weights against at most kNarrowMaxRows bf16 x rows (decode):
// each run of 64 weights of a row is widened in registers (Int4ToBf16) and
// goes straight into the dot products, so the weights leave memory as
// nibbles once and never return as bf16. x is taken in run order, the order
// the codes lie in (Int4ToBf16); per output the chain is Bf16DotProblem's
// (vdpbf16ps along K in runs of 32, then reduce16) over K in that order, so
// the bits equal linear_bf16 on x and the widened weight with K in run order,
// and run_w4_bf16's tiles below at any M: a bf16 model's int4 projection gives
// a row the same result in a decode step, a prompt's cached tail or a batch.
template <typename P>
struct Int4Bf16Problem {
  static constexpr int kWideRows = 4, kWideCols = 4, kSingleRowCols = KILN_W4_BF16_SINGLE_ROW_COLS;
  const Int4ToBf16& widen;
  const uint16_t* x;  // bf16 bits [M, K], each run of 64 in run order (Int4ToBf16)
  const uint8_t* codes;
  const P* scale_min;
  c10::BFloat16* y;
  int64_t K, N, G;

  int64_t row_bytes() const { return K / 2; }
  int64_t x_row_bytes() const { return K * 2; }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const uint16_t* __restrict xr = x + m0 * K;
    const int64_t row_stride = K / 2, groups = K / G;
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    kiln_int4::RunGroups run_groups(G);
    for (int64_t b = 0; b < K; run_groups.next_run(b += 64)) {
      const uint8_t* run = codes + n0 * row_stride + b / 2;
      if (b % 128 == 0)  // a line of the next rows (as Int4Problem)
        kiln_linear::prefetch_ahead<NR>(codes + n0 * row_stride, row_stride, b / 2);
      const bool split = run_groups.split(b);
      __m512bh wv[NR][2];
      for (int n = 0; n < NR; ++n)
        widen.widen(run + n * row_stride, widen.table(scale_min + ((n0 + n) * groups + run_groups.group) * 2, split),
                    wv[n]);
      for (int h = 0; h < 2; ++h)
        for (int m = 0; m < MR; ++m) {
          const __m512bh xv = load32(xr + m * K + b + 32 * h);
          for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, wv[n][h]);
        }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = static_cast<c10::BFloat16>(reduce16(acc[m][n]));
  }
};

// int4 group weights (linear_f32.cpp's Int4Problem layout) against bf16 x,
// for a bf16 model's batches too small to repay widening the whole weight in
// memory for oneDNN: each tile of weight rows is widened once to bf16 into a
// per-thread buffer in run order (Int4ToBf16::run_order_row: 32 weights per zmm, 4x
// fewer instructions than widen_row's 8-lane integer rounding, which was 40%
// of the micro-kernels' time at 64 rows on Zen 4) and every x row (in run
// order too) runs the micro-kernels above on it, so each output is the chain
// linear_bf16 computes on x and the whole widened weight with K in run order,
// bit for bit, whatever M (tiling as linear_f32.cpp's run_w4_tiles).
template <typename P>
void run_w4_bf16(const Int4ToBf16& widen, const uint16_t* x, const uint8_t* codes, const P* scale_min,
                 c10::BFloat16* y, int64_t M, int64_t K, int64_t N, int64_t G) {
  using Dense = Bf16DotProblem<c10::BFloat16>;
  constexpr int WR = Dense::kWideRows, WC = Dense::kWideCols;
  const int64_t tile = std::max<int64_t>(WC, kiln_linear::kWeightTileBytes / (K * 2) / WC * WC);
  const int64_t row_block = std::max<int64_t>(WR, kiln_linear::kRowBlockBytes / (K * 2) / WR * WR);
  kiln_int4::over_widened_tiles<uint16_t>(codes, scale_min, K, N, G, tile, 4 * WC,
                                          [&](const uint8_t* c, const P* p, uint16_t* out, int64_t k, int64_t g) {
                                            widen.run_order_row(c, p, out, k, g);
                                          },
                                          [&](const uint16_t* widened, int64_t t0, int64_t rows) {
    const Dense d{x, widened, y + t0, K, N};  // y's row stride stays N
    for (int64_t m0 = 0; m0 < M; m0 += row_block)
      kiln_linear::Kernels<Dense>::block(d, m0, std::min(M, m0 + row_block), 0, rows);
  });
}

// Room for x in run order (the order Int4ToBf16 widens the weights in), the
// calling thread's own, kept between calls (a decode step makes 120 of them)
// and 64-byte aligned like a tensor's storage: from malloc's 16-byte
// alignment every other zmm load of x split a cache line, and 32-row calls
// ran 12% slower.
uint16_t* run_order_buffer(int64_t n) {
  struct Buffer {
    uint16_t* data = nullptr;
    int64_t size = 0;
    ~Buffer() { std::free(data); }
  };
  thread_local Buffer buffer;
  if (n > buffer.size) {
    std::free(buffer.data);
    const int64_t bytes = (n * 2 + 63) / 64 * 64;
    buffer.data = static_cast<uint16_t*>(std::aligned_alloc(64, bytes));
    buffer.size = buffer.data != nullptr ? bytes / 2 : 0;
    TORCH_CHECK(buffer.data != nullptr, "linear_w4_bf16: out of memory");
  }
  return buffer.data;
}

// x bf16 [M, K] @ int4-group weights^T (scale_min fp16 or fp32 [N, K/G, 2]) -> bf16 [M, N].
at::Tensor linear_w4_bf16(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale_min,
                          int64_t group_size) {
  const kiln_int4::Weight w = kiln_int4::checked_weight(codes, scale_min, group_size, "linear_w4_bf16");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.K && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_w4_bf16: bf16 CPU x [M, K] required");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, w.N}, x.options());
  const Int4ToBf16 widen;
  uint16_t* x_run = run_order_buffer(M * w.K);
  const auto* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr<at::BFloat16>());
  // Threads share the copy at tile sizes (64 rows of K = 1536 are 196 KB: the copy is why 64-row
  // calls run ~1% slower than with x used in place, docs/benchmarks.md).
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) widen.to_run_order(xb + m * w.K, x_run + m * w.K, w.K);
  });
  w.with_params([&](const auto* params) {
    using Params = std::remove_cv_t<std::remove_pointer_t<decltype(params)>>;
    if (M <= kiln_linear::kNarrowMaxRows) {
      const Int4Bf16Problem<Params> p{widen, x_run, w.codes.const_data_ptr<uint8_t>(), params,
                                      y.mutable_data_ptr<c10::BFloat16>(), w.K, w.N, w.G};
      kiln_linear::Kernels<Int4Bf16Problem<Params>>::run(p, M);
    } else {
      run_w4_bf16(widen, x_run, w.codes.const_data_ptr<uint8_t>(), params, y.mutable_data_ptr<c10::BFloat16>(),
                  M, w.K, w.N, w.G);
    }
  });
  return y;
}

}  // namespace

namespace kiln {
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w) { return ::linear_bf16(x, w); }
at::Tensor linear_w4_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                          int64_t group_size) {
  return ::linear_w4_bf16(x, codes, scale_min, group_size);
}
}  // namespace kiln

// linear_w4_bf16 exists in this build only (ops.linear_w4_bf16 asks for it where it is loaded).
TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_w4_bf16(Tensor x, Tensor codes, Tensor scale_min, int group_size) -> Tensor");
  m.def("linear_q8_0_bf16(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("linear_bf16", linear_bf16);
  m.impl("linear_w4_bf16", linear_w4_bf16);
  m.impl("linear_q8_0_bf16", linear_q8_0_bf16);
}
