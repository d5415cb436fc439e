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

using kiln_simd::hsum;
using kiln_simd::softmax;

constexpr int kMaxGroup = 8;  // query heads per kv head

using kiln_simd::load8;  // pool entries as fp32 lanes

// One work item: sequence b, kv heads [g0, g1), each with its G query heads.
// Pass 1 streams the keys in slot order (each slot's heads are contiguous),
// scores every query head, and prefetches the slot's values into L2. Pass 2
// walks the values per kv head and 16-float slice of the head dimension, the
// G x 2 output vectors held in registers, reading from L2. Every output
// element is the same chain of FMAs over t in order, whatever the batch or
// the thread split.
template <int G, typename KV>
void attend(const float* q, const KV* kp, const KV* vp, const int64_t* table, int64_t first, int64_t end,
            int64_t block_size, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float softcap,
            std::vector<float>& scores, float* out) {
  // Keys first..end-1 (first > 0 under a sliding window); score column t - first.
  const int64_t nh = (g1 - g0) * G, ctx = end - first;  // scores row h = (g - g0) * G + j
  scores.resize(nh * ctx);
  for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
    for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
      const int64_t row = (base + i) * KVH;
      for (int64_t off = g0 * D * sizeof(KV); off < g1 * D * sizeof(KV); off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp + row * D) + off, _MM_HINT_T1);
      for (int64_t g = g0; g < g1; ++g) {
        const KV* key = kp + (row + g) * D;
        const float* qg = q + g * G * D;
        __m256 dots[G];
        for (int j = 0; j < G; ++j) dots[j] = _mm256_setzero_ps();
        for (int64_t d = 0; d < D; d += 8) {
          const __m256 kv = load8(key + d);
          for (int j = 0; j < G; ++j) dots[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qg + j * D + d), kv, dots[j]);
        }
        for (int j = 0; j < G; ++j) {
          const float score = hsum(dots[j]) * scale;  // soft-capped as transformers does: cap * tanh(s / cap)
          scores[((g - g0) * G + j) * ctx + t0 + i - first] = softcap > 0 ? std::tanh(score / softcap) * softcap : score;
        }
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) softmax(scores.data() + h * ctx, ctx);
  for (int64_t g = g0; g < g1; ++g) {
    const float* sg = scores.data() + (g - g0) * G * ctx;
    for (int64_t d = 0; d < D; d += 16) {
      __m256 acc[G][2];
      for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
      for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
        for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
          const KV* value = vp + ((base + i) * KVH + g) * D + d;
          const __m256 v0 = load8(value), v1 = load8(value + 8);
          for (int j = 0; j < G; ++j) {
            const __m256 p = _mm256_broadcast_ss(sg + j * ctx + t0 + i - first);
            acc[j][0] = _mm256_fmadd_ps(p, v0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(p, v1, acc[j][1]);
          }
        }
      }
      for (int j = 0; j < G; ++j) {
        _mm256_storeu_ps(out + (g * G + j) * D + d, acc[j][0]);
        _mm256_storeu_ps(out + (g * G + j) * D + d + 8, acc[j][1]);
      }
    }
  }
}

#ifdef KILN_AVX512_BF16
// attend() for the avx512_bf16 build: the same two passes, 16-lane vectors
// (keys widened to fp32 lanes as before). Pass 2 keeps S x 16 head dims of all G query heads' outputs in registers, so
// each value row is read once per S x 16 dims (the AVX2 pass reads it once
// per 16). Each output is still one chain over t in order, so results do
// not depend on the batch or the thread split; they differ from the AVX2
// build's in the summation order only.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <int G, int S, typename KV>
void attend512(const float* q, const KV* kp, const KV* vp, const int64_t* table, int64_t first, int64_t end,
               int64_t block_size, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float softcap,
               std::vector<float>& scores, float* out) {
  using kiln_simd512::reduce16;
  const int64_t nh = (g1 - g0) * G, ctx = end - first;
  scores.resize(nh * ctx);
  for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
    for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
      const int64_t row = (base + i) * KVH;
      for (int64_t off = g0 * D * sizeof(KV); off < g1 * D * sizeof(KV); off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vp + row * D) + off, _MM_HINT_T1);
      for (int64_t g = g0; g < g1; ++g) {
        const KV* key = kp + (row + g) * D;
        __m512 dots[G];
        for (int j = 0; j < G; ++j) dots[j] = _mm512_setzero_ps();
        const float* qg = q + g * G * D;
        for (int64_t d = 0; d < D; d += 16) {
          const __m512 kv = load16(key + d);
          for (int j = 0; j < G; ++j) dots[j] = _mm512_fmadd_ps(_mm512_loadu_ps(qg + j * D + d), kv, dots[j]);
        }
        for (int j = 0; j < G; ++j) {
          const float score = reduce16(dots[j]) * scale;
          scores[((g - g0) * G + j) * ctx + t0 + i - first] = softcap > 0 ? std::tanh(score / softcap) * softcap : score;
        }
      }
    }
  }
  for (int64_t h = 0; h < nh; ++h) softmax(scores.data() + h * ctx, ctx);
  for (int64_t g = g0; g < g1; ++g) {
    const float* sg = scores.data() + (g - g0) * G * ctx;
    for (int64_t d = 0; d < D; d += 16 * S) {
      __m512 acc[G][S];
      for (int j = 0; j < G; ++j)
        for (int s = 0; s < S; ++s) acc[j][s] = _mm512_setzero_ps();
      for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
        const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
        for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
          const KV* value = vp + ((base + i) * KVH + g) * D + d;
          __m512 v[S];
          for (int s = 0; s < S; ++s) v[s] = load16(value + 16 * s);
          for (int j = 0; j < G; ++j) {
            const __m512 p = _mm512_set1_ps(sg[j * ctx + t0 + i - first]);
            for (int s = 0; s < S; ++s) acc[j][s] = _mm512_fmadd_ps(p, v[s], acc[j][s]);
          }
        }
      }
      for (int j = 0; j < G; ++j)
        for (int s = 0; s < S; ++s) _mm512_storeu_ps(out + (g * G + j) * D + d + 16 * s, acc[j][s]);
    }
  }
}
#endif

template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float, std::vector<float>&, float*);

template <typename KV, int... G>
AttendFn<KV> attend_for_group(int group, int64_t D, std::integer_sequence<int, G...>) {
  AttendFn<KV> fn = nullptr;
#ifdef KILN_AVX512_BF16
  // Four 16-lane slices of outputs per pass where G x 4 accumulators fit (up to 16 of 32 registers).
  const bool wide = D % 64 == 0 && group <= 4;
  ((fn = group == G + 1 ? (wide ? attend512<G + 1, (G < 4 ? 4 : 1), KV> : attend512<G + 1, 1, KV>) : fn), ...);
#else
  (void)D;
  ((fn = group == G + 1 ? attend<G + 1, KV> : fn), ...);
#endif
  return fn;
}

template <typename KV>
void attend_all(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                const at::Tensor& lens, int64_t block_size, float scale, int64_t window, float softcap,
                at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), W = tables.size(1);
  const AttendFn<KV> attend_item =
      attend_for_group<KV>(H / KVH, D, std::make_integer_sequence<int, kMaxGroup>{});
  const float* qp = q.const_data_ptr<float>();
  const KV* kp = k_pool.const_data_ptr<KV>();
  const KV* vp = v_pool.const_data_ptr<KV>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  float* op = out.mutable_data_ptr<float>();
  // A work item is one sequence with all its kv heads. With fewer sequences
  // than threads, items are (sequence, kv head) instead.
  const bool per_head = B < at::get_num_threads();
  const int64_t items = per_head ? B * KVH : B;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = per_head ? i / KVH : i, g0 = per_head ? i % KVH : 0, g1 = per_head ? g0 + 1 : KVH;
      const int64_t first = window > 0 ? std::max<int64_t>(lp[b] - window, 0) : 0;
      attend_item(qp + b * H * D, kp, vp, tp + b * W, first, lp[b], block_size, KVH, D, g0, g1, scale, softcap,
                  scores, op + b * H * D);
    }
  });
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
  const at::Tensor q = q_in.to(at::kFloat).contiguous();  // 16-bit queries widen exactly
  const at::Tensor tables = block_tables.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  const int64_t H = q.size(1), D = q.size(2), KVH = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && D % 16 == 0 && H % KVH == 0 && H / KVH <= kMaxGroup,
              "paged_decode_attention: head layout");
  at::Tensor out = at::empty({q.size(0), H, D}, q.options());
  TORCH_CHECK(window >= 0 && softcap >= 0, "paged_decode_attention: window and softcap must be >= 0 (0: off)");
  const float fscale = static_cast<float>(scale), fcap = static_cast<float>(softcap);
  switch (k_pool.scalar_type()) {
    case at::kFloat: attend_all<float>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out); break;
    case at::kHalf:
      attend_all<at::Half>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out);
      break;
    case at::kBFloat16:
      attend_all<at::BFloat16>(q, k_pool, v_pool, tables, lens, block_size, fscale, window, fcap, out);
      break;
    default: TORCH_CHECK(false, "paged_decode_attention: pool must be float32, float16 or bfloat16");
  }
  return q_dtype == at::kFloat ? out : out.to(q_dtype);  // rounded once, as SDPA in 16 bits rounds its output
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
