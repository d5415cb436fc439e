// The geometry of one causal prefill chunk, shared by prefill_attention.cpp
// (fp32 arithmetic, every build) and prefill_attention_bf16.cpp (bf16 dot
// products, the avx512_bf16 build).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>

namespace kiln_prefill {

// q [Q, H, D] over keys [L, KVH, D] whose last Q rows are the chunk's own; G = H / KVH.
struct Geometry {
  int64_t Q, L, H, KVH, D, G, window;
  float scale, softcap;
  // Keys visible to query row r: [first_key(r), end_key(r)).
  int64_t end_key(int64_t r) const { return L - Q + r + 1; }
  int64_t first_key(int64_t r) const { return window > 0 ? std::max<int64_t>(end_key(r) - window, 0) : 0; }
};

#if KILN_AVX512_BF16
// bf16 q, k, v rows (unit inner stride, each row's heads contiguous) -> out [Q, H, D] bf16.
void attend_chunk_bf16(const Geometry& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       at::Tensor& out);
#endif

}  // namespace kiln_prefill
