// The elementwise parts of a Llama decoder layer, fused (fp32 CPU).
//
// At small batch a decode step is mostly per-op dispatch: RMSNorm is six
// torch ops, rotary sixteen, SwiGLU three, each with a few microseconds of
// overhead on a few kilobytes of data. One call each here, rows in parallel.
// Results match the torch reference to float rounding (a different summation
// order in the norm, a polynomial exp in SiLU); they do not depend on what
// else is in the batch (each row is computed alone).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cmath>
#include <tuple>

#include "kernels.h"
#include "simd.h"

namespace {

using kiln_simd::exp_nonpositive;
using kiln_simd::hsum;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.stride(1) == 1,
              name, ": 2-d fp32 CPU rows with unit inner stride required");
}

// y = w * x / sqrt(mean(x^2) + eps) for one row of K floats.
void norm_row(const float* x, const float* w, float* y, int64_t K, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t t = k; t < K; ++t) ss += x[t] * x[t];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= K; k += 8)
    _mm256_storeu_ps(y + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(x + k), vr)));
  for (; k < K; ++k) y[k] = w[k] * (x[k] * r);
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  check_rows(x, "rms_norm");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.numel() == K && w.scalar_type() == at::kFloat, "rms_norm: weight shape");
  at::Tensor y = at::empty_like(x);
  const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * K, wp, yp + m * K, K, static_cast<float>(eps));
  });
  return y;
}

// residual' = x + residual; returns (rms_norm(residual'), residual').
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                const at::Tensor& w_in, double eps) {
  const at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), w = w_in.contiguous();
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == at::kFloat, "add_rms_norm: residual shape");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.numel() == K && w.scalar_type() == at::kFloat, "add_rms_norm: weight shape");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  const float *xp = x.const_data_ptr<float>(), *rp = res.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
  float *sp = sum.mutable_data_ptr<float>(), *yp = y.mutable_data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(sp + m * K + k, _mm256_add_ps(_mm256_loadu_ps(xp + m * K + k), _mm256_loadu_ps(rp + m * K + k)));
      for (; k < K; ++k) sp[m * K + k] = xp[m * K + k] + rp[m * K + k];
      norm_row(sp + m * K, wp, yp + m * K, K, static_cast<float>(eps));
    }
  });
  return {y, sum};
}

// Rotate-half RoPE in place on x [T, H, D] (rows may be strided views of a
// fused qkv output); cos, sin [T, D/2] contiguous.
void rotate_rows(at::Tensor& x, const float* cp, const float* sp, int64_t half) {
  const int64_t T = x.size(0), H = x.size(1);
  const int64_t st = x.stride(0), sh = x.stride(1);
  float* xp = x.mutable_data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        float* a = xp + t * st + h * sh;
        float* b = a + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 va = _mm256_loadu_ps(a + i), vb = _mm256_loadu_ps(b + i);
          const __m256 vc = _mm256_loadu_ps(c + i), vs = _mm256_loadu_ps(s + i);
          _mm256_storeu_ps(a + i, _mm256_sub_ps(_mm256_mul_ps(va, vc), _mm256_mul_ps(vb, vs)));
          _mm256_storeu_ps(b + i, _mm256_add_ps(_mm256_mul_ps(vb, vc), _mm256_mul_ps(va, vs)));
        }
        for (; i < half; ++i) {
          const float va = a[i], vb = b[i];
          a[i] = va * c[i] - vb * s[i];
          b[i] = vb * c[i] + va * s[i];
        }
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_: q [T, H, D], k [T, KVH, D] required");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_: fp32 with unit inner stride required");
  const int64_t T = q.size(0), half = q.size(2) / 2;
  const at::Tensor c = cos_in.reshape({T, half}).contiguous(), s = sin_in.reshape({T, half}).contiguous();
  TORCH_CHECK(c.scalar_type() == at::kFloat && s.scalar_type() == at::kFloat, "rotary_: fp32 tables required");
  rotate_rows(q, c.const_data_ptr<float>(), s.const_data_ptr<float>(), half);
  rotate_rows(k, c.const_data_ptr<float>(), s.const_data_ptr<float>(), half);
}

// silu(g) * u with sigmoid(g) from e = exp(-|g|): 1/(1+e) for g >= 0, e/(1+e) below.
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(g, abs_mask)));
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, g);  // sign bit of g picks e
  const __m256 sig = _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

// sigmoid(u) from e = exp(-|u|): 1/(1+e) for u >= 0, e/(1+e) below.
inline __m256 sigmoid8(__m256 u) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(u, abs_mask)));
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, u);  // sign bit of u picks e
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

// GELU, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3).
inline __m256 gelu_tanh_mul8(__m256 g, __m256 u) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  return _mm256_mul_ps(_mm256_mul_ps(g, sigmoid8(_mm256_add_ps(z, z))), u);
}

inline float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// gate_up [T, 2I] (gate | up) -> act(gate) * up [T, I], act vectorized by Vec, the tail by Scalar.
template <typename Vec, typename Scalar>
at::Tensor gated_mul(const at::Tensor& gu_in, const char* name, Vec vec, Scalar scalar) {
  const at::Tensor gu = gu_in.contiguous();
  check_rows(gu, name);
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, name, ": even width required");
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * 2 * I, *u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, vec(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      for (; i < I; ++i) o[i] = scalar(g[i]) * u[i];
    }
  });
  return out;
}

// gate_up [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU).
at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
  return gated_mul(gu, "gelu_tanh_mul", gelu_tanh_mul8, gelu_tanh);
}

// gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gu_in) {
  const at::Tensor gu = gu_in.contiguous();
  check_rows(gu, "silu_mul");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, "silu_mul: even width required");
  at::Tensor out = at::empty({T, I}, gu.options());
  const float* gp = gu.const_data_ptr<float>();
  float* op = out.mutable_data_ptr<float>();
  at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float *g = gp + t * 2 * I, *u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

namespace kiln {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return ::rms_norm(x, w, eps); }
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps) {
  return ::add_rms_norm(x, residual, w, eps);
}
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) { ::rotary_(q, k, cos, sin); }
at::Tensor silu_mul(const at::Tensor& gate_up) { return ::silu_mul(gate_up); }
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) { return ::gelu_tanh_mul(gate_up); }
}  // namespace kiln


TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gate_up) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("rotary_", rotary_);
  m.impl("silu_mul", silu_mul);
  m.impl("gelu_tanh_mul", gelu_tanh_mul);
}
