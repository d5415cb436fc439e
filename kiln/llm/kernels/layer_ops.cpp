// The elementwise parts of a Llama decoder layer, fused (fp32 or bf16 CPU;
// bf16 values are widened to fp32 in registers and rounded once on store,
// except where torch's bf16 reference rounds an intermediate: there the
// kernel rounds it too).
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
// Sixteen-lane activations in both AVX-512 builds (AVX-512F/BW only).
#if KILN_AVX512_BF16 || KILN_AVX512
#define KILN_ACTIVATIONS16 1
#include "simd512.h"
#endif

namespace {

using kiln_simd::exp_nonpositive;
using kiln_simd::hsum;
using kiln_simd::load8;
using kiln_simd::round_as;
using kiln_simd::store8f;
using bf16 = c10::BFloat16;

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16) &&
                  t.device().is_cpu() && t.stride(1) == 1,
              name, ": 2-d fp32 or bf16 CPU rows with unit inner stride required");
}

// Runs f.template operator()<T>() for T = float or bf16 by the tensor's dtype.
template <typename F>
auto by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) return f.template operator()<bf16>();
  return f.template operator()<float>();
}

// y = w * round_T(x / sqrt(mean(x^2) + eps)) for one row of K values of T;
// the sum of squares and the scaling in fp32 (the reference normalises in
// fp32, then casts to T before the weight multiply: Hugging Face's order).
template <typename T>
void norm_row(const T* x, const T* w, T* y, int64_t K, float eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 v = load8(x + k);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum(acc);
  for (int64_t t = k; t < K; ++t) ss += static_cast<float>(x[t]) * static_cast<float>(x[t]);
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(K) + eps);
  const __m256 vr = _mm256_set1_ps(r);
  for (k = 0; k + 8 <= K; k += 8)
    store8f(y + k, _mm256_mul_ps(load8(w + k), round_as<T>(_mm256_mul_ps(load8(x + k), vr))));
  for (; k < K; ++k) y[k] = static_cast<T>(static_cast<float>(w[k]) * round_as<T>(static_cast<float>(x[k]) * r));
}

at::Tensor rms_norm(const at::Tensor& x_in, const at::Tensor& w_in, double eps) {
  const at::Tensor x = x_in.contiguous(), w = w_in.contiguous();
  check_rows(x, "rms_norm");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.numel() == K && w.scalar_type() == x.scalar_type(), "rms_norm: weight shape and dtype");
  at::Tensor y = at::empty_like(x);
  by_dtype(x, [&]<typename T>() {
    const T *xp = x.const_data_ptr<T>(), *wp = w.const_data_ptr<T>();
    T* yp = y.mutable_data_ptr<T>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) norm_row(xp + m * K, wp, yp + m * K, K, static_cast<float>(eps));
    });
  });
  return y;
}

// s[i] = a[i] + b[i] for n values of T: one fp32 add rounded to T, as torch's add (s may be a or b).
template <typename T>
void add_values(const T* a, const T* b, T* s, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) store8f(s + i, _mm256_add_ps(load8(a + i), load8(b + i)));
  for (; i < n; ++i) s[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
}

// residual' = x + residual (rounded to T); returns (rms_norm(residual'), residual').
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x_in, const at::Tensor& res_in,
                                                const at::Tensor& w_in, double eps) {
  const at::Tensor x = x_in.contiguous(), res = res_in.contiguous(), w = w_in.contiguous();
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "add_rms_norm: residual shape");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.numel() == K && w.scalar_type() == x.scalar_type(), "add_rms_norm: weight shape and dtype");
  at::Tensor sum = at::empty_like(x), y = at::empty_like(x);
  by_dtype(x, [&]<typename T>() {
    const T *xp = x.const_data_ptr<T>(), *rp = res.const_data_ptr<T>(), *wp = w.const_data_ptr<T>();
    T *sp = sum.mutable_data_ptr<T>(), *yp = y.mutable_data_ptr<T>();
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        add_values(xp + m * K, rp + m * K, sp + m * K, K);
        norm_row(sp + m * K, wp, yp + m * K, K, static_cast<float>(eps));
      }
    });
  });
  return {y, sum};
}

// out + residual, written into out where both are contiguous rows of one
// shape and dtype (fp32 or bf16): the bits of torch's `residual + out` (one
// fp32 add, rounded to T) without the new tensor its add allocates, ~2 us of
// a one-row decode layer. Else `residual + out` itself.
at::Tensor add_into(at::Tensor& out, const at::Tensor& residual) {
  const bool in_place = out.dim() == 2 && out.is_contiguous() && residual.is_contiguous() &&
                        out.sizes() == residual.sizes() && out.scalar_type() == residual.scalar_type() &&
                        (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16) && out.is_cpu() &&
                        residual.is_cpu();
  if (!in_place) return residual + out;
  const int64_t K = out.size(1);
  by_dtype(out, [&]<typename T>() {
    T* op = out.mutable_data_ptr<T>();
    const T* rp = residual.const_data_ptr<T>();
    at::parallel_for(0, out.size(0), 16, [&](int64_t m0, int64_t m1) {
      add_values(rp + m0 * K, op + m0 * K, op + m0 * K, (m1 - m0) * K);
    });
  });
  return out;
}

// Rotate-half RoPE in place on x [T, H, D] of T (rows may be strided views of
// a fused qkv output); cos, sin [T, D/2] of C (fp32, or a bf16 model's bf16
// tables, widened exactly as torch's type promotion does) contiguous. fp32
// arithmetic, one rounding on store (the reference rotates x.float(), then casts back).
template <typename T, typename C>
void rotate_rows(at::Tensor& x, const C* cp, const C* sp, int64_t half) {
  const int64_t tokens = x.size(0), H = x.size(1);
  const int64_t st = x.stride(0), sh = x.stride(1);
  T* xp = x.mutable_data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const C *c = cp + t * half, *s = sp + t * half;
      for (int64_t h = 0; h < H; ++h) {
        T* a = xp + t * st + h * sh;
        T* b = a + half;
        int64_t i = 0;
        for (; i + 8 <= half; i += 8) {
          const __m256 va = load8(a + i), vb = load8(b + i);
          const __m256 vc = load8(c + i), vs = load8(s + i);
          store8f(a + i, _mm256_sub_ps(_mm256_mul_ps(va, vc), _mm256_mul_ps(vb, vs)));
          store8f(b + i, _mm256_add_ps(_mm256_mul_ps(vb, vc), _mm256_mul_ps(va, vs)));
        }
        for (; i < half; ++i) {
          const float va = static_cast<float>(a[i]), vb = static_cast<float>(b[i]);
          a[i] = static_cast<T>(va * c[i] - vb * s[i]);
          b[i] = static_cast<T>(vb * c[i] + va * s[i]);
        }
      }
    }
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos_in, const at::Tensor& sin_in) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary_: q [T, H, D], k [T, KVH, D] required");
  TORCH_CHECK((q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16) &&
                  k.scalar_type() == q.scalar_type() && q.stride(2) == 1 && k.stride(2) == 1,
              "rotary_: fp32 or bf16 q and k with unit inner stride required");
  const int64_t T = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(cos_in.is_floating_point() && sin_in.is_floating_point(), "rotary_: float tables required");
  // A bf16 model's bf16 tables are read as they are; any other float tables as fp32.
  const bool bf16_tables = cos_in.scalar_type() == at::kBFloat16 && sin_in.scalar_type() == at::kBFloat16;
  const at::ScalarType table_dtype = bf16_tables ? at::kBFloat16 : at::kFloat;
  const at::Tensor c = cos_in.reshape({T, half}).to(table_dtype).contiguous();
  const at::Tensor s = sin_in.reshape({T, half}).to(table_dtype).contiguous();
  by_dtype(q, [&]<typename X>() {
    by_dtype(c, [&]<typename C>() {
      rotate_rows<X>(q, c.const_data_ptr<C>(), s.const_data_ptr<C>(), half);
      rotate_rows<X>(k, c.const_data_ptr<C>(), s.const_data_ptr<C>(), half);
    });
  });
}

// sigmoid(u) from e = exp(-|u|): 1/(1+e) for u >= 0, e/(1+e) below.
inline __m256 sigmoid8(__m256 u) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_setzero_ps(), _mm256_and_ps(u, abs_mask)));
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, u);  // sign bit of u picks e
  return _mm256_div_ps(num, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

inline __m256 silu8(__m256 g) { return _mm256_mul_ps(g, sigmoid8(g)); }

inline float silu(float g) { return g / (1.0f + std::exp(-g)); }

// GELU, tanh approximation: 0.5 g (1 + tanh(z)) = g sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3).
inline __m256 gelu_tanh8(__m256 g) {
  const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
  return _mm256_mul_ps(g, sigmoid8(_mm256_add_ps(z, z)));
}

#if KILN_ACTIVATIONS16
// The eight-lane activations above in sixteen lanes (the AVX-512 builds),
// operation for operation, so every value is bit-identical to theirs.
inline __m512 sigmoid16(__m512 u) {
  const __m512 e = kiln_simd512::exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(u)));
  const __mmask16 negative = _mm512_movepi32_mask(_mm512_castps_si512(u));  // blendv's sign-bit choice
  const __m512 num = _mm512_mask_blend_ps(negative, _mm512_set1_ps(1.0f), e);
  return _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e));
}

inline __m512 silu16(__m512 g) { return _mm512_mul_ps(g, sigmoid16(g)); }

inline __m512 gelu_tanh16(__m512 g) {
  const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 z = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), g3, g));
  return _mm512_mul_ps(g, sigmoid16(_mm512_add_ps(z, z)));
}
#endif

inline float gelu_tanh(float g) {
  return 0.5f * g * (1.0f + std::tanh(0.7978845608028654f * (g + 0.044715f * g * g * g)));
}

// gate_up [T, 2I] (gate | up) -> act(gate) * up [T, I], act vectorized by Vec,
// the tail by Scalar. In bf16, act(gate) is rounded before the multiply, as
// torch's act(gate) * up rounds it.
template <typename Vec16, typename Vec, typename Scalar>
at::Tensor gated_mul(const at::Tensor& gu_in, const char* name, [[maybe_unused]] Vec16 act16, Vec act8, Scalar act) {
  const at::Tensor gu = gu_in.contiguous();
  check_rows(gu, name);
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) == 2 * I, name, ": even width required");
  at::Tensor out = at::empty({T, I}, gu.options());
  by_dtype(gu, [&]<typename X>() {
    const X* gp = gu.const_data_ptr<X>();
    X* op = out.mutable_data_ptr<X>();
    at::parallel_for(0, T, 4, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const X *g = gp + t * 2 * I, *u = g + I;
        X* o = op + t * I;
        int64_t i = 0;
#if KILN_ACTIVATIONS16
        namespace v16 = kiln_simd512;
        for (; i + 16 <= I; i += 16)
          v16::store16(o + i, _mm512_mul_ps(v16::round_as<X>(act16(v16::load16(g + i))), v16::load16(u + i)));
#endif
        for (; i + 8 <= I; i += 8) store8f(o + i, _mm256_mul_ps(round_as<X>(act8(load8(g + i))), load8(u + i)));
        for (; i < I; ++i) o[i] = static_cast<X>(round_as<X>(act(static_cast<float>(g[i]))) * static_cast<float>(u[i]));
      }
    });
  });
  return out;
}

// The activations go to gated_mul as lambdas, not function pointers: a
// lambda's type names its body, so it inlines into the loop (through a
// pointer every vector was a call, and silu_mul ran at ~1 element per ns).
#define KILN_INLINE(f) [](auto v) { return f(v); }
#if KILN_ACTIVATIONS16
#define KILN_ACT16(f) KILN_INLINE(f##16)
#else
#define KILN_ACT16(f) nullptr  // the avx2 build has no sixteen-lane loop
#endif

// gate_up [T, 2I] (gate | up) -> silu(gate) * up [T, I].
at::Tensor silu_mul(const at::Tensor& gu) {
  return gated_mul(gu, "silu_mul", KILN_ACT16(silu), KILN_INLINE(silu8), KILN_INLINE(silu));
}

// gate_up [T, 2I] (gate | up) -> gelu_tanh(gate) * up [T, I] (Gemma's GeGLU).
at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
  return gated_mul(gu, "gelu_tanh_mul", KILN_ACT16(gelu_tanh), KILN_INLINE(gelu_tanh8), KILN_INLINE(gelu_tanh));
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
at::Tensor add_into(at::Tensor& out, const at::Tensor& residual) { return ::add_into(out, residual); }
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
