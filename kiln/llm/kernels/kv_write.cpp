// Writes a step's keys and values into the paged pool: row t of k and v goes
// to slot slot_mapping[t] of each pool. Same result as
// `pool.index_copy_(0, slot_mapping, k.to(pool.dtype))`, which walks the
// rows element by element (about 1 ms for a 1024-token bf16 chunk of one
// layer here); each row here is one memcpy of KVH * D values. The slots of a
// step are distinct (the scheduler gives every token its own), so rows are
// written in parallel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>

#include "kernels.h"
#include "simd.h"

namespace {

void check_side(const at::Tensor& pool, const at::Tensor& rows, const at::Tensor& slots, const char* which) {
  TORCH_CHECK(pool.dim() == 3 && rows.dim() == 3 && pool.size(1) == rows.size(1) && pool.size(2) == rows.size(2),
              "write_kv: ", which, " rows [T, KVH, D] must match the pool's [slots, KVH, D]");
  TORCH_CHECK(pool.is_contiguous() && pool.device().is_cpu(), "write_kv: contiguous CPU pool required");
  TORCH_CHECK(rows.size(0) == slots.size(0), "write_kv: one slot per row");
}

// Rows already in the pool's dtype, each [KVH, D] contiguous (the row stride may be anything).
void copy_rows(const at::Tensor& pool, const at::Tensor& rows, const int64_t* slots) {
  const int64_t T = rows.size(0), width = rows.size(1) * rows.size(2);
  const int64_t bytes = width * static_cast<int64_t>(pool.element_size());
  const int64_t stride = rows.stride(0) * static_cast<int64_t>(rows.element_size());
  const char* src = static_cast<const char*>(rows.const_data_ptr());
  char* dst = static_cast<char*>(pool.mutable_data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) std::memcpy(dst + slots[t] * bytes, src + t * stride, bytes);
  });
}

// Whether a row of `rows` is KVH * D packed values (any row stride).
bool inner_packed(const at::Tensor& rows) { return rows.stride(2) == 1 && rows.stride(1) == rows.size(2); }

// fp32 rows into a 16-bit pool, each rounded to nearest even as it is stored
// (kiln_simd::store8f: the bits of rows.to(pool dtype) for every value but
// NaN, which stays a NaN: bf16 0x7fc0 as c10::BFloat16(float) makes it): at
// decode sizes the temporary that .to() allocates cost more than the copy
// (one row: ~5 us of a ~6 us call, 30 calls a step).
template <typename T>
void narrow_rows(const at::Tensor& pool, const at::Tensor& rows, const int64_t* slots) {
  const int64_t T_rows = rows.size(0), width = rows.size(1) * rows.size(2);
  const float* src = rows.const_data_ptr<float>();
  T* dst = static_cast<T*>(pool.mutable_data_ptr());
  at::parallel_for(0, T_rows, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* from = src + t * rows.stride(0);
      T* to = dst + slots[t] * width;
      for (int64_t i = 0; i < width; i += 8) kiln_simd::store8f(to + i, kiln_simd::load8(from + i));
    }
  });
}

// Rows written by narrow_rows: fp32 values, packed rows of a multiple of 8, a 16-bit float pool.
bool narrows_in_place(const at::Tensor& pool, const at::Tensor& rows) {
  const at::ScalarType dtype = pool.scalar_type();
  return rows.scalar_type() == at::kFloat && (dtype == at::kHalf || dtype == at::kBFloat16) &&
         inner_packed(rows) && (rows.size(1) * rows.size(2)) % 8 == 0;
}

at::Tensor in_pool_dtype(const at::Tensor& rows, at::ScalarType dtype) {
  at::Tensor out = rows.to(dtype);  // rounded as index_copy_'s caller rounds (a view when dtypes agree)
  return inner_packed(out) ? out : out.contiguous();
}

void write_side(const at::Tensor& pool, const at::Tensor& rows, const int64_t* slots) {
  if (!narrows_in_place(pool, rows)) return copy_rows(pool, in_pool_dtype(rows, pool.scalar_type()), slots);
  if (pool.scalar_type() == at::kHalf) return narrow_rows<c10::Half>(pool, rows, slots);
  narrow_rows<c10::BFloat16>(pool, rows, slots);
}

void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1, "write_kv: int64 slot_mapping");
  check_side(k_pool, k, slot_mapping, "key");
  check_side(v_pool, v, slot_mapping, "value");
  const at::Tensor slots = slot_mapping.contiguous();
  const int64_t* sp = slots.const_data_ptr<int64_t>();
  for (int64_t t = 0; t < slots.size(0); ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_pool.size(0), "write_kv: slot ", sp[t], " outside the pool");
  write_side(k_pool, k, sp);
  write_side(v_pool, v, sp);
}

}  // namespace

namespace kiln {
void write_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& slot_mapping) {
  ::write_kv(k_pool, v_pool, k, v, slot_mapping);
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("write_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor k, Tensor v, Tensor slot_mapping) -> ()");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("write_kv", write_kv); }
