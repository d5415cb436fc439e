// Kiln's CPU kernels as C++ functions, for kernels built from others (the
// fused decoder layer). Each is also registered as a torch op under kiln::.
#pragma once
#include <ATen/ATen.h>

#include <tuple>

namespace kiln {

at::Tensor linear_f32(const at::Tensor& x, const at::Tensor& w);
// x fp32 or bf16 [M, K] @ w bf16 [N, K]^T -> x's dtype. The AVX512_BF16 build:
// bf16 dot products (linear_bf16.cpp); the AVX2 build: fp32 arithmetic.
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& w);
at::Tensor linear_w8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
// The builds with VNNI only (avx512_vnni, avx512_bf16): x quantized to int8 in groups of 32, VNNI dot products.
at::Tensor linear_w8a8(const at::Tensor& x, const at::Tensor& w, const at::Tensor& scales);
// int4 group weights (linear_f32.cpp's Int4Problem layout): linear_w4 keeps
// x in fp32; linear_w4a8 quantizes it to int8 in groups of 32 (linear_w4a8.cpp).
at::Tensor linear_w4(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min, int64_t group_size);
at::Tensor linear_w4a8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min, int64_t group_size);
#if KILN_AVX512_BF16
// bf16 x @ int4 group weights widened to bf16 -> bf16, bf16 dot products
// (linear_bf16.cpp): one chain per output whatever M, so any M gives a row the same bits.
at::Tensor linear_w4_bf16(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale_min,
                          int64_t group_size);
// bf16 x @ int4 group weights in lane layout (linear_w4l_bf16.cpp) -> bf16:
// sixteen weight rows per vector, weights unrounded; any M gives a row the same bits.
// next_lanes: the lanes of the call that follows on the same threads, whose
// first one-row pass each thread requests during its last one here (or null).
// copy: the projection's bf16 copy in lane layout (or null), which steps of
// kLaneCopyMinRows rows or more take instead (linear_bf16_lanes).
at::Tensor linear_w4l_bf16(const at::Tensor& x, const at::Tensor& lanes, const at::Tensor& params,
                           int64_t group_size, const at::Tensor* next_lanes = nullptr,
                           const at::Tensor* copy = nullptr);
// bf16 x @ bf16 weights in lane layout [N/16, K/2, 16, 2] (linear_bf16_lanes.cpp) -> bf16:
// one chain per output whatever M, so any M gives a row the same bits.
at::Tensor linear_bf16_lanes(const at::Tensor& x, const at::Tensor& lanes);
#endif
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
// out + residual, into out where it can be (contiguous fp32 / bf16 rows of one shape); returns the sum.
at::Tensor add_into(at::Tensor& out, const at::Tensor& residual);
at::Tensor gelu_tanh_mul(const at::Tensor& gate_up);
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale, int64_t window = 0, double softcap = 0.0);
// k, v [T, KVH, D] (any float dtype) -> pool slots slot_mapping[t], as index_copy_ of k.to(pool dtype).
void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping);

}  // namespace kiln
