// Skinny fp32 linear for CPU: y[M,N] = x[M,K] @ w[N,K]^T for small M.
//
// Decode and speculative verification multiply a handful of rows by every
// weight matrix. BLAS packs the weights per call for such shapes, so the
// time goes to moving weights, not to arithmetic. Here each weight row is
// streamed from memory once per group of up to 8 input rows (held in L1) and
// dotted with all of them (larger M: in L2-sized tiles, see below). Rows are independent and reduced in a fixed
// order, so a row's result does not depend on M or on the other rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

namespace {

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(_mm_hadd_ps(s, s));
}

template <int M>
void rows(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    __m256 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= K; k += 8) {
      const __m256 wv = _mm256_loadu_ps(wr + k);
      for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t t = k; t < K; ++t) s += x[m * K + t] * wr[t];
      y[m * N + n] = s;
    }
  }
}

using RowsFn = void (*)(const float*, const float*, float*, int64_t, int64_t, int64_t, int64_t);
constexpr RowsFn kRows[9] = {nullptr, rows<1>, rows<2>, rows<3>, rows<4>, rows<5>, rows<6>, rows<7>, rows<8>};

at::Tensor skinny_linear(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1), "skinny_linear: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear: float32 only");
  TORCH_CHECK(w.is_contiguous() && x_in.device().is_cpu(), "skinny_linear: contiguous CPU weight required");
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const float* xp = x.const_data_ptr<float>();
  const float* wp = w.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  // Weight rows are taken in tiles that stay in L2 while every group of 8
  // input rows passes over them: the weight leaves DRAM once whatever M is.
  const int64_t tile = std::max<int64_t>(1, (64 * 1024) / (K * sizeof(float)));
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(n1, t0 + tile);
      for (int64_t m = 0; m < M; m += 8) {
        const int64_t g = std::min<int64_t>(8, M - m);
        kRows[g](xp + m * K, wp, yp + m * N, K, N, t0, t1);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("skinny_linear(Tensor x, Tensor w) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("skinny_linear", skinny_linear); }
