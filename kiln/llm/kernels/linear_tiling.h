// Tiling and threading shared by Kiln's linear kernels (y[M, N] = x[M, K] @ W^T).
//
// A problem P knows one weight format and provides micro<MR, NR>(m, n),
// which computes y[m .. m+MR, n .. n+NR], plus its tile shape:
//   P::kWideRows, P::kWideCols   the register block for M > kNarrowMaxRows
//   P::kSingleRowCols            weight rows per pass for M = 1
//   P::narrow_cols(M) (optional) weight rows per pass for 1 < M <= 8, where a
//                                problem's micro-kernel takes other counts
//                                than kiln_linear::narrow_cols(M)
//   row_bytes(), x_row_bytes()   bytes of one weight row and one x row
// Kernels<P>::run tiles and threads any of them the same way. Every output
// must be computed by micro-kernels as the same chain of operations whatever
// MR and NR are, so a row's result does not depend on M (batch invariance).
//
// Micro-kernel shapes:
// - M <= 8 (decode, speculative verification, a MoE expert's few tokens):
//   all rows against narrow_cols(M) w rows per pass (kSingleRowCols for
//   M = 1), so each weight row leaves memory once; the step is
//   bandwidth-bound. The w rows per pass keep >= 8 independent FMA chains
//   (two FMA units x four cycles of latency) within 16 registers: with one w
//   row, M = 2 ran at 2.4x M = 1's time on Zen 3 (half the chains idle).
// - M > 8: the wide register block; the step is compute-bound.
// Weight rows are taken in tiles that stay in L2 while every group of x rows
// passes over them; x is taken in L2-sized row blocks. Threads claim chunks
// of N (guided_for).
#pragma once
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "parallel_chunks.h"
#include "simd.h"

namespace kiln_linear {

// Weight rows are software-prefetched this many micro-kernel passes ahead,
// and at least kPrefetchMinBytes ahead.
#ifndef KILN_PREFETCH_PASSES
#define KILN_PREFETCH_PASSES 1
#endif
constexpr int kPrefetchPasses = KILN_PREFETCH_PASSES;
// A pass of one int8 row of 576 bytes (SmolLM2's K) put the prefetch only
// ~9 lines ahead, less than a DRAM latency's worth of bytes at a thread's
// share of the bandwidth, so each miss waited. With 4 KB: int8 one-row
// projections 1.05-1.08x faster, the int8 Q8_0 head 1.06x, int4 1.04x, four
// rows 1.08x; fp32 and bf16 (passes of 4.6-9.2 KB already) unchanged; 2 KB
// and 8 KB no better (Ice Lake, 2 threads, docs/benchmarks.md).
#ifndef KILN_PREFETCH_MIN_BYTES
#define KILN_PREFETCH_MIN_BYTES 4096
#endif
constexpr int64_t kPrefetchMinBytes = (KILN_PREFETCH_MIN_BYTES + 63) / 64 * 64;

// Requests weight rows max(kPrefetchPasses passes, kPrefetchMinBytes) ahead.
// A pass reads NR consecutive rows (row_bytes each) side by side, and the rows
// of the passes ahead are one contiguous run. Called once for every 64 bytes a
// pass advances along its rows (`offset` bytes done), this asks for NR lines
// of that run in address order, so the weights are requested as one linear
// stream a fixed distance ahead. Asking for the same line of each of the NR
// rows instead (NR streams side by side) read 1.05-1.3x slower from DRAM on
// one Zen 3 thread (bench/weight_streams.c), and the int8 and bf16 one-row
// kernels ran 1.1-1.45x faster this way (docs/benchmarks.md). kHint: where
// the lines go (into L1 unless a kernel measured better otherwise).
template <int NR, int kHint = _MM_HINT_T0>
inline void prefetch_ahead(const void* pass, int64_t row_bytes, int64_t offset) {
  const int64_t ahead = std::max<int64_t>(kPrefetchPasses * row_bytes * NR, kPrefetchMinBytes);
  const char* run = static_cast<const char*>(pass) + ahead + offset * NR;
  for (int j = 0; j < NR; ++j) _mm_prefetch(run + 64 * j, static_cast<_mm_hint>(kHint));
}
// sums[m][n] = kiln_simd::hsum(acc[m][n]), bit for bit; four rows at a time
// through hsum4. The 4 x 3 micro-kernel's twelve sums at the end of a pass
// showed as ~10% of its profile at K = 576; summed by four it ran 1.01-1.04x
// faster on Zen 3 (docs/benchmarks.md).
template <int MR, int NR>
inline void lane_sums(const __m256 (&acc)[MR][NR], float (&sums)[MR][NR]) {
  int m = 0;
  for (; m + 4 <= MR; m += 4)
    for (int n = 0; n < NR; ++n) {
      alignas(16) float four[4];
      _mm_store_ps(four, kiln_simd::hsum4(acc[m][n], acc[m + 1][n], acc[m + 2][n], acc[m + 3][n]));
      for (int i = 0; i < 4; ++i) sums[m + i][n] = four[i];
    }
  for (; m < MR; ++m)
    for (int n = 0; n < NR; ++n) sums[m][n] = kiln_simd::hsum(acc[m][n]);
}

constexpr int64_t kNarrowMaxRows = 8;
constexpr int64_t kWeightTileBytes = 64 * 1024, kRowBlockBytes = 256 * 1024;

// W rows per pass for M <= kNarrowMaxRows x rows (M > 1): M x cols
// accumulators + cols weights + one x register fit in 16 ymm registers.
constexpr int narrow_cols(int m) { return m == 2 ? 4 : m == 3 ? 3 : m <= 6 ? 2 : 1; }

template <typename P>
constexpr int narrow_cols_of(int m) {
  if constexpr (requires { P::narrow_cols(m); })
    return P::narrow_cols(m);
  else
    return narrow_cols(m);
}

template <typename P>
struct Kernels {
  using Fn = void (*)(const P&, int64_t, int64_t);
  static constexpr int WR = P::kWideRows, WC = P::kWideCols, SC = P::kSingleRowCols;

  template <int MR, int NR>
  static void call(const P& p, int64_t m, int64_t n) {
    p.template micro<MR, NR>(m, n);
  }
  // narrow[m - 1]: m rows against narrow_cols_of<P>(m) w rows; narrow_tail[m - 1]: against one (the
  // last N % those rows). wide[(m - 1) * WC + n - 1]: m <= WR rows by n <= WC w rows.
  static constexpr std::array<Fn, kNarrowMaxRows> narrow = []<int... I>(std::integer_sequence<int, I...>) {
    return std::array<Fn, kNarrowMaxRows>{call<I + 1, narrow_cols_of<P>(I + 1)>...};
  }(std::make_integer_sequence<int, kNarrowMaxRows>{});
  static constexpr std::array<Fn, kNarrowMaxRows> narrow_tail = []<int... I>(std::integer_sequence<int, I...>) {
    return std::array<Fn, kNarrowMaxRows>{call<I + 1, 1>...};
  }(std::make_integer_sequence<int, kNarrowMaxRows>{});
  static constexpr std::array<Fn, WR * WC> wide = []<int... I>(std::integer_sequence<int, I...>) {
    return std::array<Fn, WR * WC>{call<I / WC + 1, I % WC + 1>...};
  }(std::make_integer_sequence<int, WR * WC>{});

  // Rows [m0, m1) against w rows [n0, n1).
  static void block(const P& p, int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    if (m1 - m0 == 1) {  // one chain per w row is latency-bound: take SC w rows per pass
      int64_t n = n0;
      for (; n + SC <= n1; n += SC) call<1, SC>(p, m0, n);
      for (; n < n1; ++n) call<1, 1>(p, m0, n);
      return;
    }
    if (m1 - m0 <= kNarrowMaxRows) {
      const int64_t rows = m1 - m0, cols = narrow_cols_of<P>(static_cast<int>(rows));
      int64_t n = n0;
      for (; n + cols <= n1; n += cols) narrow[rows - 1](p, m0, n);
      for (; n < n1; ++n) narrow_tail[rows - 1](p, m0, n);
      return;
    }
    for (int64_t m = m0; m < m1; m += WR) {
      const int64_t mr = std::min<int64_t>(WR, m1 - m);
      for (int64_t n = n0; n < n1; n += WC) wide[(mr - 1) * WC + std::min<int64_t>(WC, n1 - n) - 1](p, m, n);
    }
  }

  static void run(const P& p, int64_t M) {
    const int64_t N = p.N;
    const int64_t tile = std::max<int64_t>(WC, kWeightTileBytes / p.row_bytes() / WC * WC);
    // A row block is a multiple of the wide kernel's rows, or all of a small M.
    const int64_t rows =
        M <= kNarrowMaxRows ? M : std::max<int64_t>(WR, kRowBlockBytes / p.x_row_bytes() / WR * WR);
    kiln_parallel::guided_for(N, 4 * WC, [&] {
      return [&](int64_t n_begin, int64_t n_end) {
        for (int64_t m0 = 0; m0 < M; m0 += rows) {
          const int64_t m1 = std::min(M, m0 + rows);
          for (int64_t t0 = n_begin; t0 < n_end; t0 += tile) block(p, m0, m1, t0, std::min(n_end, t0 + tile));
        }
      };
    });
  }
};

}  // namespace kiln_linear
