// int4 group-wise weights (linear_f32.cpp's Int4Problem layout) widened to
// fp32 [N, K] in memory, for prefill-sized inputs: there a GEMM on the
// widened weight (oneDNN, 2-2.5x the int4 kernel's rate at 512-1000 rows)
// pays for widening every weight once per call, which torch ops did at ~10x
// this function's cost (docs/benchmarks.md, "int4 prefill"). bf16 models on
// CPUs with bf16 dot products widen to bf16 (for oneDNN's bf16 GEMM above
// INT4_BF16_DEQUANT_MIN_ROWS rows, kiln/llm/kernels/tuning.py).
//
// Each row as int4_widen.h's widen_row: the weight the kernel multiplies by
// (bf16 in the avx512_bf16 build: Int4ToBf16, linear_w4_bf16's own widening,
// 32 weights per zmm).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <cstdint>

#include "int4_widen.h"
#if KILN_AVX512_BF16
#include "int4_widen_bf16.h"
#endif

namespace {

using kiln_int4::widen_row;

template <typename P, typename O>
void widen(const at::Tensor& codes, const P* params, O* o, int64_t G) {
  const int64_t N = codes.size(0), K = codes.size(1) * 2, groups = K / G;
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) widen_row(c + n * (K / 2), params + n * groups * 2, o + n * K, K, G);
  });
}

template <typename P>
void widen_bf16(const at::Tensor& codes, const P* params, uint16_t* o, int64_t G) {
#if KILN_AVX512_BF16
  const int64_t N = codes.size(0), K = codes.size(1) * 2, groups = K / G;
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const kiln_int4::Int4ToBf16 to_bf16;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      to_bf16.natural_row(c + n * (K / 2), params + n * groups * 2, o + n * K, K, G);
  });
#else
  widen(codes, params, o, G);
#endif
}

template <typename P>
void widen_to(const at::Tensor& codes, const P* params, at::Tensor& out, int64_t G) {
  if (out.scalar_type() == at::kFloat)
    widen(codes, params, out.mutable_data_ptr<float>(), G);
  else
    widen_bf16(codes, params, reinterpret_cast<uint16_t*>(out.mutable_data_ptr<at::BFloat16>()), G);
}

// codes uint8 [N, K/2], scale_min fp16 or fp32 [N, K/G, 2] -> fp32 [N, K]
// (bf16: the same values rounded, in one pass).
at::Tensor dequantize_w4(const at::Tensor& codes, const at::Tensor& scale_min, int64_t group_size, bool bf16) {
  const kiln_int4::Weight w = kiln_int4::checked_weight(codes, scale_min, group_size, "dequantize_w4");
  at::Tensor out = at::empty({w.N, w.K}, w.codes.options().dtype(bf16 ? at::kBFloat16 : at::kFloat));
  w.with_params([&](const auto* params) { widen_to(w.codes, params, out, w.G); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("dequantize_w4(Tensor codes, Tensor scale_min, int group_size, bool bf16=False) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("dequantize_w4", dequantize_w4); }
