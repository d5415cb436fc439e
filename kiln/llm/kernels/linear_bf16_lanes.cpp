// bf16 weights in lane layout against bf16 x (the avx512_bf16 build only):
// the outer product of linear_w4l_bf16.cpp on weights already in bf16, so
// no widening and no per-group epilogue. It serves the bf16 weight copies
// kept for steps of many rows on CPUs with AVX512_BF16 and no AMX
// (ops.copy_for_many_rows): the int4 lane projections' (`--int4-prefill-weights`,
// quant/int4_lanes.py; kLaneCopyMinRows rows or more), a bf16 Linear's and
// the LM head's (more than packed_min_rows rows, layers/linear.py `project`).
//
// Layout (kiln/llm/kernels/ops.py `bf16_lanes_copy` writes it):
//   lanes   bf16 [N/16, K/2, 16, 2]: block r, pair c, lane j holds
//           (w[16r + j, 2c], w[16r + j, 2c + 1])
// so one zmm load is sixteen rows' pairs, and vdpbf16ps against the
// broadcast x pair (x[2c], x[2c + 1]) adds both products into each row's
// fp32 lane. Every output is one chain: the vdpbf16ps over c in order from
// zero, rounded to bf16 once, whatever M, the tile or the thread, so a row's
// bits do not depend on the batch.
//
// Tiles of 8 x rows by 3 blocks (24 accumulators, 3 weight loads and 8
// broadcasts per 24 vdpbf16ps); the rows a tile leaves go as one tile of
// that many. SmolLM2's 120 projections, Zen 4, 2 threads, GFLOP/s against
// the int4 lanes (whose per-group scale and min cost two FMAs per sixteen
// vdpbf16ps) and oneDNN on packed bf16 weights: 16 rows 308 / 298 / -;
// 24 rows 342 / 317 / 267; 39 rows 376 / 314 / 306; 64 rows 397 / 342 / 343;
// 2,048 rows 428 / 354 / 425 (6 x 4, 4 x 6 and 10 x 2 tiles within 3%;
// 8 rows 239 / 259: below 16 rows the int4 codes, a quarter of the bytes,
// win; docs/benchmarks.md).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kCopyLanes = 16;        // weight rows per zmm
constexpr int kCopyTileRows = 8;      // x rows per tile
constexpr int kCopyTileBlocks = 3;    // blocks of sixteen weight rows per tile
constexpr int64_t kCopyRowChunk = 96;  // x rows per sweep over a thread's blocks (they stay in L2)

struct Bf16LaneProduct {
  const uint16_t* x;      // bf16 bits [M, K]
  const uint32_t* lanes;  // bf16 pairs [N/16, K/2, 16]
  uint16_t* y;            // bf16 bits [M, N]
  int64_t M, K, N;

  // Rows m0..m0+MR against blocks r0..r0+NR.
  template <int MR, int NR>
  void micro(int64_t m0, int64_t r0) const {
    const int64_t pairs = K / 2;
    __m512 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_setzero_ps();
    const uint32_t* w0 = lanes + r0 * pairs * kCopyLanes;
    for (int64_t c = 0; c < pairs; ++c) {
      __m512bh w[NR];
      for (int n = 0; n < NR; ++n) w[n] = (__m512bh)_mm512_loadu_si512(w0 + (n * pairs + c) * kCopyLanes);
      for (int m = 0; m < MR; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + (m0 + m) * K + 2 * c, sizeof(pair));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
        for (int n = 0; n < NR; ++n) acc[m][n] = _mm512_dpbf16_ps(acc[m][n], xv, w[n]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + (r0 + n) * kCopyLanes),
                            (__m256i)_mm512_cvtneps_pbh(acc[m][n]));
  }

  // The last `rows` (< kCopyTileRows) rows from m0 as one tile of that many.
  template <int NR, int R = 1>
  void tail(int rows, int64_t m0, int64_t r0) const {
    if constexpr (R < kCopyTileRows) {
      if (rows == R) return micro<R, NR>(m0, r0);
      tail<NR, R + 1>(rows, m0, r0);
    }
  }

  template <int NR>
  void row_tiles(int64_t m0, int64_t m1, int64_t r) const {
    int64_t m = m0;
    for (; m + kCopyTileRows <= m1; m += kCopyTileRows) micro<kCopyTileRows, NR>(m, r);
    if (m < m1) tail<NR>(static_cast<int>(m1 - m), m, r);
  }

  // Parallel over blocks; each thread sweeps its blocks once per chunk of rows.
  void run() const {
    const int64_t blocks = N / kCopyLanes;
    at::parallel_for(0, blocks, kCopyTileBlocks, [&](int64_t r0, int64_t r1) {
      for (int64_t m0 = 0; m0 < M; m0 += kCopyRowChunk) {
        const int64_t m1 = std::min(M, m0 + kCopyRowChunk);
        int64_t r = r0;
        for (; r + kCopyTileBlocks <= r1; r += kCopyTileBlocks) row_tiles<kCopyTileBlocks>(m0, m1, r);
        for (; r < r1; ++r) row_tiles<1>(m0, m1, r);
      }
    });
  }
};

}  // namespace

namespace kiln {
at::Tensor linear_bf16_lanes(const at::Tensor& x_in, const at::Tensor& lanes_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_bf16_lanes: bf16 CPU x [M, K] required");
  TORCH_CHECK(lanes_in.dim() == 4 && lanes_in.scalar_type() == at::kBFloat16 && lanes_in.size(2) == kCopyLanes &&
                  lanes_in.size(3) == 2 && lanes_in.device().is_cpu(),
              "linear_bf16_lanes: bf16 CPU lanes [N/16, K/2, 16, 2] required");
  const at::Tensor x = x_in.contiguous(), lanes = lanes_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = lanes.size(0) * kCopyLanes;
  TORCH_CHECK(lanes.size(1) * 2 == K, "linear_bf16_lanes: x has ", K, " columns, the weight ", lanes.size(1) * 2);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  Bf16LaneProduct p{reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>()),
                    reinterpret_cast<const uint32_t*>(lanes.const_data_ptr<c10::BFloat16>()),
                    reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()), M, K, N};
  p.run();
  return y;
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("linear_bf16_lanes(Tensor x, Tensor lanes) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_bf16_lanes", kiln::linear_bf16_lanes); }
