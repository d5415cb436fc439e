// Paged decode attention for CPU: one query token per sequence, keys and
// values read in place from the paged pool through block tables. The pool
// holds fp32, fp16 or bf16 (`kv_cache_dtype`); 16-bit entries are widened to
// fp32 in registers, so the arithmetic is fp32 either way and a 16-bit pool
// halves the bytes this memory-bound kernel reads. Queries may be fp32, bf16
// or fp16 (a 16-bit model's); the output takes their dtype, rounded once.
//
// The torch reference gathers every context into a padded batch before
// SDPA, so each key is read, written and read again. Here each sequence
// streams its keys once for all query heads (GQA groups share a key), then
// its values once: the pool is read exactly once per layer.
// Work per pair depends only on that sequence, so results do not depend on
// what else is in the batch. A sliding window (`window` > 0) starts the
// keys at context_len - window; `softcap` > 0 soft-caps the scores (Gemma 2).
// The avx512_bf16 build runs the same passes on 16-lane vectors and keeps up
// to 64 head dims of outputs in registers per pass over the values (7-15%
// faster on Zen 4, docs/benchmarks.md); its dot products sum their lanes in
// another order than the AVX2 build's, so the two builds agree to rounding.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"
#include "simd.h"
#ifdef KILN_AVX512_BF16
#include "simd512.h"
#endif

namespace {

using kiln_simd::softmax;

constexpr int kMaxGroup = 8;  // query heads per kv head

// The vector width a build attends with: 8 fp32 lanes (AVX2) or 16 (the
// avx512_bf16 build). Pool entries load as fp32 lanes (16-bit ones widened);
// `sum` adds the lanes in one fixed order.
struct Lanes8 {
  using Vec = __m256;
  static constexpr int64_t kLanes = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  template <typename T>
  static Vec load(const T* p) { return kiln_simd::load8(p); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static Vec set1(float x) { return _mm256_set1_ps(x); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
  static float sum(Vec v) { return kiln_simd::hsum(v); }
};

#ifdef KILN_AVX512_BF16
struct Lanes16 {
  using Vec = __m512;
  static constexpr int64_t kLanes = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load(const c10::BFloat16* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static Vec load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static Vec set1(float x) { return _mm512_set1_ps(x); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
  static float sum(Vec v) { return kiln_simd512::reduce16(v); }
};
#endif

// One work item: sequence b, kv heads [g0, g1), each with its G query heads.
// Pass 1 streams the keys in slot order (each slot's heads are contiguous),
// scores every query head, and prefetches the slot's values and the next
// block's keys into L2. Pass 2
// walks the values per kv head and slice of S vectors of the head dimension
// (AVX2: 2 x 8 floats; 16 lanes: 4 x 16 where G x 4 accumulators fit, else
// 1 x 16), the G x S output vectors held in registers, reading from L2.
// Every output element is the same chain of FMAs over t in order, whatever
// the batch or the thread split.
template <int G, int S, typename V, typename KV>
void attend(const float* q, const KV* kp, const KV* vp, const int64_t* table, int64_t first, int64_t end,
            int64_t block_size, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float softcap,
            std::vector<float>& scores, float* out) {
  using Vec = typename V::Vec;
  // Keys first..end-1 (first > 0 under a sliding window); score column t - first.
  const int64_t nh = (g1 - g0) * G, ctx = end - first;  // scores row h = (g - g0) * G + j
  scores.resize(nh * ctx);
  for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
    // The next block's keys into L2, one slot per key scored here: blocks lie
    // anywhere in the pool, so the hardware prefetcher cannot run ahead of a
    // block boundary (into L1 instead, or all at the block's start: slower).
    const KV* next_keys = t0 + block_size < end ? kp + table[t0 / block_size + 1] * block_size * KVH * D : nullptr;
    for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
      const int64_t row = (base + i) * KVH;
      for (int64_t off = g0 * D * sizeof(KV); off < g1 * D * sizeof(KV); off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vp + row * D) + off, _MM_HINT_T1);
        if (next_keys) _mm_prefetch(reinterpret_cast<const char*>(next_keys + i * KVH * D) + off, _MM_HINT_T1);
      }
      for (int64_t g = g0; g < g1; ++g) {
        const KV* key = kp + (row + g) * D;
        const float* qg = q + g * G * D;
        Vec dots[G];
        for (int j = 0; j < G; ++j) dots[j] = V::zero();
        for (int64_t d = 0; d < D; d += V::kLanes) {
          const Vec kv = V::load(key + d);
          for (int j = 0; j < G; ++j) dots[j] = V::fma(V::load(qg + j * D + d), kv, dots[j]);
        }
        for (int j = 0; j < G; ++j) {
          const float score = V::sum(dots[j]) * scale;  // soft-capped as transformers does: cap * tanh(s / cap)
          scores[((g - g0) * G + j) * ctx + t0 + i - first] = softcap > 0 ? std::tanh(score / softcap) * softcap : score;
        }
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) softmax(scores.data() + h * ctx, ctx);
  for (int64_t g = g0; g < g1; ++g) {
    const float* sg = scores.data() + (g - g0) * G * ctx;
    for (int64_t d = 0; d < D; d += S * V::kLanes) {
      Vec acc[G][S];
      for (int j = 0; j < G; ++j)
        for (int s = 0; s < S; ++s) acc[j][s] = V::zero();
      for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
        for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
          const KV* value = vp + ((base + i) * KVH + g) * D + d;
          Vec v[S];
          for (int s = 0; s < S; ++s) v[s] = V::load(value + s * V::kLanes);
          for (int j = 0; j < G; ++j) {
            const Vec p = V::set1(sg[j * ctx + t0 + i - first]);
            for (int s = 0; s < S; ++s) acc[j][s] = V::fma(p, v[s], acc[j][s]);
          }
        }
      }
      for (int j = 0; j < G; ++j)
        for (int s = 0; s < S; ++s) V::store(out + (g * G + j) * D + d + s * V::kLanes, acc[j][s]);
    }
  }
}

template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float, std::vector<float>&, float*);

template <typename KV, int... G>
AttendFn<KV> attend_for_group(int group, int64_t D, std::integer_sequence<int, G...>) {
  AttendFn<KV> fn = nullptr;
#ifdef KILN_AVX512_BF16
  // Four 16-lane slices of outputs per pass where G x 4 accumulators fit (up to 16 of 32 registers).
  const bool wide = D % 64 == 0 && group <= 4;
  ((fn = group == G + 1 ? (wide ? attend<G + 1, (G < 4 ? 4 : 1), Lanes16, KV> : attend<G + 1, 1, Lanes16, KV>)
                        : fn), ...);
#else
  (void)D;
  ((fn = group == G + 1 ? attend<G + 1, 2, Lanes8, KV> : fn), ...);
#endif
  return fn;
}

// A sequence's query row widened to fp32 (Q = fp32: read in place), and
// where its outputs go before rounding to Q (Q = fp32: written in place).
template <typename Q>
struct QueryRows {
  const Q* q;
  Q* out;
  int64_t q_stride, HD;

  const float* widened(int64_t b, std::vector<float>& buf) const {
    if constexpr (std::is_same_v<Q, float>) {
      return q + b * q_stride;
    } else {
      buf.resize(HD);  // 16-bit queries widen exactly
      for (int64_t i = 0; i < HD; ++i) buf[i] = static_cast<float>(q[b * q_stride + i]);
      return buf.data();
    }
  }
  float* staging(int64_t b, std::vector<float>& buf) const {
    if constexpr (std::is_same_v<Q, float>) {
      return out + b * HD;
    } else {
      buf.resize(HD);
      return buf.data();
    }
  }
  // Outputs [lo, hi) of sequence b rounded once to Q, as SDPA in 16 bits rounds its output.
  void store(int64_t b, const std::vector<float>& buf, int64_t lo, int64_t hi) const {
    if constexpr (!std::is_same_v<Q, float>)
      for (int64_t i = lo; i < hi; ++i) out[b * HD + i] = static_cast<Q>(buf[i]);
  }
};

template <typename KV, typename Q>
void attend_all(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                const at::Tensor& lens, int64_t block_size, float scale, int64_t window, float softcap,
                at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), W = tables.size(1);
  const int64_t group = H / KVH;
  const AttendFn<KV> attend_item =
      attend_for_group<KV>(group, D, std::make_integer_sequence<int, kMaxGroup>{});
  const QueryRows<Q> rows{q.const_data_ptr<Q>(), out.mutable_data_ptr<Q>(), q.stride(0), H * D};
  const KV* kp = k_pool.const_data_ptr<KV>();
  const KV* vp = v_pool.const_data_ptr<KV>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  // A work item is one sequence with all its kv heads. With fewer sequences
  // than threads, items are (sequence, kv head) instead.
  const bool per_head = B < at::get_num_threads();
  const int64_t items = per_head ? B * KVH : B;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, q32, out32;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = per_head ? i / KVH : i, g0 = per_head ? i % KVH : 0, g1 = per_head ? g0 + 1 : KVH;
      const int64_t first = window > 0 ? std::max<int64_t>(lp[b] - window, 0) : 0;
      attend_item(rows.widened(b, q32), kp, vp, tp + b * W, first, lp[b], block_size, KVH, D, g0, g1, scale,
                  softcap, scores, rows.staging(b, out32));
      rows.store(b, out32, g0 * group * D, g1 * group * D);
    }
  });
}

template <typename KV>
void attend_any_query(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                      const at::Tensor& tables, const at::Tensor& lens, int64_t block_size, float scale,
                      int64_t window, float softcap, at::Tensor& out) {
  switch (q.scalar_type()) {
    case at::kFloat:
      attend_all<KV, float>(q, k_pool, v_pool, tables, lens, block_size, scale, window, softcap, out);
      break;
    case at::kBFloat16:
      attend_all<KV, at::BFloat16>(q, k_pool, v_pool, tables, lens, block_size, scale, window, softcap, out);
      break;
    default: attend_all<KV, at::Half>(q, k_pool, v_pool, tables, lens, block_size, scale, window, softcap, out);
  }
}

at::Tensor paged_decode_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && k_pool.dim() == 3 && v_pool.sizes() == k_pool.sizes(), "paged_decode_attention: shapes");
  const at::ScalarType q_dtype = q_in.scalar_type();
  TORCH_CHECK(q_dtype == at::kFloat || q_dtype == at::kBFloat16 || q_dtype == at::kHalf,
              "paged_decode_attention: float32, bfloat16 or float16 queries");
  TORCH_CHECK(v_pool.scalar_type() == k_pool.scalar_type(), "paged_decode_attention: one pool dtype");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode_attention: contiguous pool required");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong, "int64 tables");
  // Heads of a row contiguous (a narrow of a fused qkv output is: its rows are strided).
  const at::Tensor q = q_in.stride(2) == 1 && q_in.stride(1) == q_in.size(2) ? q_in : q_in.contiguous();
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && D % 16 == 0 && H % KVH == 0 && H / KVH <= kMaxGroup,
              "paged_decode_attention: head layout");
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode_attention: window and softcap must be >= 0 (0: off)");
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  switch (k_pool.scalar_type()) {
    case at::kFloat:
      attend_any_query<float>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out);
      break;
    case at::kHalf:
      attend_any_query<at::Half>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out);
      break;
    case at::kBFloat16:
      attend_any_query<at::BFloat16>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out);
      break;
    default: TORCH_CHECK(false, "paged_decode_attention: pool must be float32, float16 or bfloat16");
  }
  return out;
}

}  // namespace

namespace kiln {
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, int64_t block_size,
                                  double scale, int64_t window, double softcap) {
  return ::paged_decode_attention(q, k_pool, v_pool, block_tables, context_lens, block_size, scale, window, softcap);
}
}  // namespace kiln


TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor context_lens, "
        "int block_size, float scale, int window=0, float softcap=0.0) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("paged_decode_attention", paged_decode_attention); }
