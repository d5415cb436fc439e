// int4 group-wise weights (linear_f32.cpp's Int4Problem layout) times a
// prompt-sized fp32 x: y[M, N] = x[M, K] @ W^T, for the rows where the int4
// kernel's dot products (linear_w4) are compute-bound at ~100-140 GFLOP/s.
//
// Threads claim W's panels of 16 rows (64 in the avx512 build) in turn
// (guided_for). Each panel is widened once per call (int4_widen.h's
// widen_row: the weights linear_w4 multiplies by) and laid out k-major,
// panel[k][16], then every x row passes over it in a 6 x 16 outer-product
// micro-kernel (6 x 64 on AVX-512): per k, two (four) panel vectors, six
// broadcasts of x and twelve (24) FMAs, the accumulators never summed across
// lanes. The avx2 build takes K in blocks of kKBlock so that a panel's block
// (16 KiB) stays in L1 while the x rows stream by; between blocks the
// accumulators go through y (or a scratch) and come back. The avx512 build
// takes K in blocks of 2048 (a block of its panel, 512 KiB, streams from L2;
// SmolLM2's K is one block).
//
// Every output is one chain, y[m, n] = fma(x[m, k], w[n, k], y) for k = 0, 1,
// ... K-1 from 0, in fp32: storing and reloading an fp32 accumulator is exact,
// and the chain is the same for every micro-kernel shape and vector width
// (the avx2 and avx512 builds give the same bits), so a row's result
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
#include <memory>
#include <vector>

#include "int4_widen.h"
#include "parallel_chunks.h"
#include "simd.h"

namespace {

#if KILN_AVX512
// Sixteen-lane vectors: the panel is four of them, six x rows a pass (24
// accumulators + 4 panel vectors of the 32 registers), over K blocks of 2048:
// a block of the panel (64 x 2048 floats, 512 KiB) stays in L2, the
// accumulators in registers through the block. On Ice Lake, SmolLM2's four
// shapes at 504 rows, one thread (a standalone copy of this loop, best of
// 12): 12 x 32 in K blocks of 128 102-111 GFLOP/s, 6 x 64 with K whole
// (576, 1536) 132-140. At K = 8192 and 14336 (N 1024 and 512, 256 and 512
// rows, 2 threads, in one process) K whole ran 1.54-1.68x slower than
// blocks of 2048 (its panel, 2-3.5 MiB, no longer fits L2); blocks of 1024
// measured 0.99-1.13x of 2048, of 512 0.94-0.95x.
using Vec = __m512;
constexpr int64_t kPanel = 64;   // weight rows per panel: four AVX-512 vectors of outputs
constexpr int64_t kRows = 6;     // x rows per micro-kernel pass
constexpr int64_t kKBlock = 2048;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_load_ps(p); }
inline Vec vloadu(const float* p) { return _mm512_loadu_ps(p); }
inline void vstoreu(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#define KILN_PANEL_VECS(X) X(0) X(1) X(2) X(3)
#define KILN_PANEL_VECS_OF(X, m) X(m, 0) X(m, 1) X(m, 2) X(m, 3)
#else
using Vec = __m256;
constexpr int64_t kPanel = 16;   // weight rows per panel: two AVX2 vectors of outputs
constexpr int64_t kRows = 6;     // x rows per micro-kernel pass: 6 x 2 accumulators + 2 panel vectors + 1 broadcast
constexpr int64_t kKBlock = 256; // a panel's block: 256 x 16 floats = 16 KiB
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_load_ps(p); }
inline Vec vloadu(const float* p) { return _mm256_loadu_ps(p); }
inline void vstoreu(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#define KILN_PANEL_VECS(X) X(0) X(1)
#define KILN_PANEL_VECS_OF(X, m) X(m, 0) X(m, 1)
#endif
#define KILN_PANEL_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)
constexpr int64_t kVecLanes = sizeof(Vec) / sizeof(float);
constexpr int64_t kMBlock = 240; // x rows per block, a multiple of kRows

// c[m, 0 .. kPanel] (row stride ldc) for the kRows x rows m (row stride K)
// over k in [k0, k1): the accumulators start at 0 (kFirst) or at c, and end
// in c. Named accumulators: GCC kept an array of them on the stack,
// storing each after every FMA (62 GFLOP/s instead of ~170 on AVX2).
template <bool kFirst>
void micro(const float* x, int64_t K, const float* panel, int64_t k0, int64_t k1, float* c, int64_t ldc) {
  // acc_m_v: x row m times panel vector v (outputs v * kVecLanes ..).
#define KILN_ACC_INIT_V(m, v) Vec acc##m##_##v = kFirst ? vzero() : vloadu(c + (m) * ldc + (v) * kVecLanes);
#define KILN_ACC_FMA_V(m, v) acc##m##_##v = vfma(xv, w##v, acc##m##_##v);
#define KILN_ACC_STORE_V(m, v) vstoreu(c + (m) * ldc + (v) * kVecLanes, acc##m##_##v);
#define KILN_ACC_INIT(m) KILN_PANEL_VECS_OF(KILN_ACC_INIT_V, m)
#define KILN_ACC_FMA(m)                          \
  {                                              \
    const Vec xv = vbroadcast(x + (m) * K + k);  \
    KILN_PANEL_VECS_OF(KILN_ACC_FMA_V, m)        \
  }
#define KILN_ACC_STORE(m) KILN_PANEL_VECS_OF(KILN_ACC_STORE_V, m)
#define KILN_LOAD_W(v) const Vec w##v = vload(panel + k * kPanel + (v) * kVecLanes);
  KILN_PANEL_ROWS(KILN_ACC_INIT)
  for (int64_t k = k0; k < k1; ++k) {
    KILN_PANEL_VECS(KILN_LOAD_W)
    KILN_PANEL_ROWS(KILN_ACC_FMA)
  }
  KILN_PANEL_ROWS(KILN_ACC_STORE)
#undef KILN_ACC_INIT_V
#undef KILN_ACC_FMA_V
#undef KILN_ACC_STORE_V
#undef KILN_ACC_INIT
#undef KILN_ACC_FMA
#undef KILN_ACC_STORE
#undef KILN_LOAD_W
}
#undef KILN_PANEL_ROWS
#undef KILN_PANEL_VECS
#undef KILN_PANEL_VECS_OF

// Rows [n0, n0 + cols) of W widened and laid out k-major into `panel` (K x kPanel,
// rows past `cols` zero); `rows` is scratch for the row-major widening.
template <typename P>
void widen_panel(const kiln_int4::Weight& w, const P* params, int64_t n0, int64_t cols, std::vector<float>& rows,
                 float* panel) {
  const int64_t K = w.K, groups = K / w.G;
  const uint8_t* codes = w.codes.const_data_ptr<uint8_t>();
  if (cols < kPanel) std::fill(rows.begin() + cols * K, rows.end(), 0.0f);
  for (int64_t j = 0; j < cols; ++j)
    kiln_int4::widen_row(codes + (n0 + j) * (K / 2), params + (n0 + j) * groups * 2, rows.data() + j * K, K, w.G);
  // 8 x 8 blocks (K and kPanel are multiples of 8). A scalar transpose took
  // ~12% of a 512-row call on Ice Lake (SmolLM2's shapes at 6 rows, one
  // thread: 3.3 ms, 1.7-2.6 with the blocks).
  for (int64_t j = 0; j < kPanel; j += 8)
    for (int64_t k = 0; k < K; k += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(rows.data() + (j + i) * K + k);
      kiln_simd::transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (k + i) * kPanel + j, r[i]);
    }
}

// Each panel is widened once per call; x rows then pass over it kMBlock at
// a time (in the avx2 build a k-block of them, 60-240 KiB, stays in L2 while
// the panel's k-blocks pass over it). A panel's outputs go straight to y, or
// for the last panel of an N that is not a multiple of kPanel through a
// [rows, kPanel] scratch whose first columns are copied out. The last M %
// kRows rows run through a kRows-row scratch copy (zero rows past M; each
// row's chain is its own, so the padding changes no output). kMBlock is a
// multiple of kRows, so only the last block has such rows.
template <typename P>
void run(const float* x, const kiln_int4::Weight& w, const P* params, float* y, int64_t M) {
  const int64_t K = w.K, N = w.N, panels = (N + kPanel - 1) / kPanel, full = M / kRows * kRows;
  kiln_parallel::guided_for(panels, 1, [&] {
    // This thread's buffers, for every panel it claims.
    std::vector<float> x_tail(kRows * K, 0.0f);
    std::copy(x + full * K, x + M * K, x_tail.begin());
    return [&, rows = std::vector<float>(kPanel * K), scratch = std::vector<float>(kMBlock * kPanel),
            x_tail = std::move(x_tail), c_tail = std::vector<float>(kRows * kPanel),
            panel = std::unique_ptr<float, decltype(&std::free)>(
                static_cast<float*>(std::aligned_alloc(64, kPanel * K * sizeof(float))), &std::free)](
               int64_t begin, int64_t end) mutable {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
        widen_panel(w, params, n0, cols, rows, panel.get());
        for (int64_t m0 = 0; m0 < M; m0 += kMBlock) {
          const int64_t m1 = std::min(M, m0 + kMBlock), m_full = std::min(m1, full);
          float* c = cols < kPanel ? scratch.data() : y + m0 * N + n0;  // row m0 + i at c + i * ldc
          const int64_t ldc = cols < kPanel ? kPanel : N;
          for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
            const int64_t k1 = std::min(K, k0 + kKBlock);
            const auto fn = k0 == 0 ? micro<true> : micro<false>;
            for (int64_t m = m0; m < m_full; m += kRows) fn(x + m * K, K, panel.get(), k0, k1, c + (m - m0) * ldc, ldc);
            if (m_full < m1) fn(x_tail.data(), K, panel.get(), k0, k1, c_tail.data(), kPanel);
          }
          for (int64_t m = m_full; m < m1; ++m)
            std::copy(c_tail.data() + (m - full) * kPanel, c_tail.data() + (m - full + 1) * kPanel, c + (m - m0) * ldc);
          if (cols < kPanel)
            for (int64_t m = m0; m < m1; ++m)
              std::copy(c + (m - m0) * kPanel, c + (m - m0) * kPanel + cols, y + m * N + n0);
        }
      }
    };
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
