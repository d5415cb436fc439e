// Tiling and threading shared by Kiln's linear kernels (y[M, N] = x[M, K] @ W^T).
//
// A problem P knows one weight format and provides micro<MR, NR>(m, n),
// which computes y[m .. m+MR, n .. n+NR], plus its tile shape:
//   P::kWideRows, P::kWideCols   the register block for M > kNarrowMaxRows
//   P::kSingleRowCols            weight rows per pass for M = 1
//   row_bytes(), x_row_bytes()   bytes of one weight row and one x row
// Kernels<P>::run tiles and threads any of them the same way. Every output
// must be computed by micro-kernels as the same chain of operations whatever
// MR and NR are, so a row's result does not depend on M (batch invariance).
//
// Micro-kernel shapes:
// - M <= 8 (decode, speculative verification): all rows against one w row
//   (kSingleRowCols w rows for M = 1, for enough independent chains), so each
//   weight row leaves memory once; the step is bandwidth-bound.
// - M > 8: the wide register block; the step is compute-bound.
// Weight rows are taken in tiles that stay in L2 while every group of x rows
// passes over them; x is taken in L2-sized row blocks. Threads split N.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

namespace kiln_linear {

// Weight rows are software-prefetched this many micro-kernel passes ahead.
#ifndef KILN_PREFETCH_PASSES
#define KILN_PREFETCH_PASSES 1
#endif
constexpr int kPrefetchPasses = KILN_PREFETCH_PASSES;
constexpr int64_t kNarrowMaxRows = 8;
constexpr int64_t kWeightTileBytes = 64 * 1024, kRowBlockBytes = 256 * 1024;

template <typename P>
struct Kernels {
  using Fn = void (*)(const P&, int64_t, int64_t);
  static constexpr int WR = P::kWideRows, WC = P::kWideCols, SC = P::kSingleRowCols;

  template <int MR, int NR>
  static void call(const P& p, int64_t m, int64_t n) {
    p.template micro<MR, NR>(m, n);
  }
  // narrow[m - 1]: m rows against one w row. wide[(m - 1) * WC + n - 1]: m <= WR rows by n <= WC w rows.
  static constexpr std::array<Fn, kNarrowMaxRows> narrow = []<int... I>(std::integer_sequence<int, I...>) {
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
      const Fn fn = narrow[m1 - m0 - 1];
      for (int64_t n = n0; n < n1; ++n) fn(p, m0, n);
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
    at::parallel_for(0, N, 4 * WC, [&](int64_t n_begin, int64_t n_end) {
      for (int64_t m0 = 0; m0 < M; m0 += rows) {
        const int64_t m1 = std::min(M, m0 + rows);
        for (int64_t t0 = n_begin; t0 < n_end; t0 += tile) block(p, m0, m1, t0, std::min(n_end, t0 + tile));
      }
    });
  }
};

}  // namespace kiln_linear
