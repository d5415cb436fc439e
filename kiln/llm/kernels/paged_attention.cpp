// Paged decode attention for CPU: one query token per sequence, keys and
// values read in place from the paged pool through block tables. The pool
// holds fp32, fp16 or bf16 (`kv_cache_dtype`); 16-bit entries are widened to
// fp32 in registers, so the arithmetic is fp32 either way and a 16-bit pool
// halves the bytes this memory-bound kernel reads (the avx512_bf16 build
// scores a bf16 pool against bf16 queries on bf16 dot products: dot_chains).
// Queries may be fp32, bf16 or fp16 (a 16-bit model's); the output takes
// their dtype, rounded once.
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
// faster on Zen 4, docs/benchmarks.md; with its prefetches paced, 1.06x
// faster than the avx2 build there, 2026-12-07); its dot products sum their
// lanes in another order than the AVX2 build's, so the two builds agree to
// rounding.
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
#include "parallel_chunks.h"
#include "lanes.h"
#include "simd.h"
// Sixteen lanes in the avx512_bf16 build only (AVX-512F is all it uses; 7-15%
// faster than eight on Zen 4, docs/benchmarks.md). The avx512 and avx512_vnni
// builds attend on eight lanes, the avx2 build's code and bits: on Ice Lake,
// from memory (the pool of a real step), 1.05-1.27x faster than sixteen lanes
// at 8-64 sequences (both with the prefetch below inlined), level at one
// (bench/paged_attention.py, 2026-12-07).
#if KILN_AVX512_BF16
#define KILN_ATTEND_LANES16 1
#endif

namespace {

using kiln_simd::softmax;

constexpr int kMaxGroup = 8;  // query heads per kv head

// The vector width a build attends with (lanes.h): 8 fp32 lanes (AVX2) or 16
// (the avx512 and avx512_bf16 builds).
using kiln_lanes::Lanes8;
#ifdef KILN_ATTEND_LANES16
using kiln_lanes::Lanes16;
#endif

// Keys scored at once by an item of one kv head (fewer sequences than
// threads and not split: batch 1 below kSplitMinKeys keys): each score is a
// chain of D / lanes dependent FMAs, so one key's G chains leave the FMA
// units waiting on their latency (4 cycles on Zen 3); K keys give K x G
// independent chains (up to 12 accumulators, 16 registers on AVX2). Each
// chain is unchanged, so each score keeps its bits. An item of all kv heads
// scores one key at a time: its KVH x G chains per key are independent
// already, and runs of keys, faster from cache, ran 0.79-0.89x from DRAM
// there (64 sequences, Zen 3).
template <int G>
constexpr int kKeysAtOnce = G == 1 ? 8 : G <= 3 ? 4 : G <= 6 ? 2 : 1;

// Soft-capped as transformers does: cap * tanh(s / cap) (softcap > 0: Gemma 2).
inline void soft_cap(float* row, int n, float softcap) {
  if (softcap > 0)
    for (int k = 0; k < n; ++k) row[k] = std::tanh(row[k] / softcap) * softcap;
}

#if KILN_AVX512_BF16
// Scores by bf16 dot products, for a bf16 pool and bf16 queries (a bf16
// model's, whose fp32 rows here are exact widenings, narrowed back exactly):
// vdpbf16ps adds two head dims' products per lane, so a 64-dim score is two
// instructions on the keys as stored (four key widenings and four FMAs per
// query head with fp32 lanes). Each score is still one chain along the head
// dimension whatever the keys beside it, its lanes summed by reduce16's
// tree, so batch and split leave its bits alone; the lanes pair the head
// dims other than the fp32 chains do, which it agrees with to rounding.
inline __m512bh query_pairs(const float* q) { return _mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)); }

// The chains of G query heads against K consecutive keys; before_step(k, d)
// runs before key k's step at head dim d (score_keys paces its prefetches
// by it).
template <int G, int K, typename BeforeStep>
inline void dot_chains(const float* qg, const c10::BFloat16* key, int64_t key_stride, int64_t D,
                       __m512 (&dots)[G][K], BeforeStep before_step) {
  for (int j = 0; j < G; ++j)
    for (int k = 0; k < K; ++k) dots[j][k] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512bh qv[G];
    for (int j = 0; j < G; ++j) qv[j] = query_pairs(qg + j * D + d);
    for (int k = 0; k < K; ++k) {
      before_step(k, d);
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(key + k * key_stride + d);
      for (int j = 0; j < G; ++j) dots[j][k] = _mm512_dpbf16_ps(dots[j][k], qv[j], kv);
    }
  }
}
#endif

// Scores of K consecutive keys (slot rows `row`, `row + KVH`, ...) against
// kv head g's G query heads into score rows `out` (stride ctx), columns
// [0, K): each a chain of FMAs along the head dimension, lanes summed by
// V::sum (AVX2, K a multiple of 4: hsum4, the same bits four at a time).
template <int G, int K, typename V, typename KV, bool kDot = false>
inline void score_run(const float* qg, const KV* key, int64_t key_stride, int64_t D, float scale, float softcap,
                      float* out, int64_t ctx) {
  using Vec = typename V::Vec;
#if KILN_AVX512_BF16
  if constexpr (kDot) {
    __m512 dots[G][K];
    dot_chains<G, K>(qg, key, key_stride, D, dots, [](int, int64_t) {});
    for (int j = 0; j < G; ++j) {
      for (int k = 0; k < K; ++k) out[j * ctx + k] = V::sum(dots[j][k]) * scale;
      soft_cap(out + j * ctx, K, softcap);
    }
    return;
  }
#endif
  Vec dots[K][G];
  for (int k = 0; k < K; ++k)
    for (int j = 0; j < G; ++j) dots[k][j] = V::zero();
  for (int64_t d = 0; d < D; d += V::kLanes) {
    for (int k = 0; k < K; ++k) {
      const Vec kv = V::load(key + k * key_stride + d);
      for (int j = 0; j < G; ++j) dots[k][j] = V::fma(V::load(qg + j * D + d), kv, dots[k][j]);
    }
  }
  for (int j = 0; j < G; ++j) {
    float* row = out + j * ctx;
    if constexpr (V::kLanes == 8 && K % 4 == 0) {
      for (int k = 0; k < K; k += 4) {
        alignas(16) float sums[4];
        _mm_store_ps(sums, kiln_simd::hsum4(dots[k][j], dots[k + 1][j], dots[k + 2][j], dots[k + 3][j]));
        for (int i = 0; i < 4; ++i) row[k + i] = sums[i] * scale;
      }
    } else {
      for (int k = 0; k < K; ++k) row[k] = V::sum(dots[k][j]) * scale;
    }
    soft_cap(row, K, softcap);
  }
}

#ifdef KILN_ATTEND_LANES16
// The lane sums of R = 4 or 8 vectors at once, lane r = reduce16(v[r]) bit
// for bit: the same pairs added in the same order (lanes i + i+8, then
// i + i+4, i + i+2, i + i+1), R vectors per instruction instead of one. With
// a head dimension of 64, a score is four FMAs and reduce16 seven dependent
// instructions: on Ice Lake (measured when the avx512 builds attended on 16
// lanes) 0.96-1.24x for contexts in cache (2-8 sequences 1.05-1.24x),
// 0.97-1.03x from memory (docs/benchmarks.md).
template <int R>
inline void store_sums(const __m512 (&v)[R], float scale, float* out) {
  static_assert(R == 4 || R == 8);
  __m512 halves[R / 2];  // pair p: [a.q0 + a.q2, a.q1 + a.q3, b.q0 + b.q2, b.q1 + b.q3] (128-bit quarters)
  for (int p = 0; p < R / 2; ++p)
    halves[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 quarters[R / 4];  // quarter k: vector 4j + k's four partial sums
  for (int j = 0; j < R / 4; ++j)
    quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                                _mm512_shuffle_f32x4(halves[2 * j], halves[2 * j + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 lo = quarters[0], hi = R == 8 ? quarters[R / 4 - 1] : quarters[0];
  // Quarter k: [c_k0, c_k1, c_{k+4}0, c_{k+4}1] with c_r0 = b_r0 + b_r2, c_r1 = b_r1 + b_r3.
  const __m512 pairs = _mm512_add_ps(_mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)),
                                     _mm512_shuffle_ps(lo, hi, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 sums = _mm512_add_ps(pairs, _mm512_movehdup_ps(pairs));  // vector k at lane 4k, k + 4 at 4k + 2
  const __m512 ordered = _mm512_permutexvar_ps(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 10, 6, 2, 12, 8, 4, 0),
                                               _mm512_mul_ps(sums, _mm512_set1_ps(scale)));
  if constexpr (R == 8)
    _mm256_storeu_ps(out, _mm512_castps512_ps256(ordered));
  else
    _mm_storeu_ps(out, _mm512_castps512_ps128(ordered));
}

// Keys scored at once with the summing above: G x R accumulators, G query
// vectors and a key vector within the 32 registers.
template <int G>
constexpr int kTreeKeys = G <= 3 ? 8 : G <= 6 ? 4 : 0;

// The FMA chains of score_run<G, R, Lanes16> for R consecutive keys, the
// accumulators laid out for store_sums; before_step as in dot_chains.
template <int G, int R, typename KV, typename BeforeStep>
inline void fma_chains(const float* qg, const KV* key, int64_t key_stride, int64_t D, __m512 (&dots)[G][R],
                       BeforeStep before_step) {
  using V = Lanes16;
  for (int j = 0; j < G; ++j)
    for (int r = 0; r < R; ++r) dots[j][r] = V::zero();
  for (int64_t d = 0; d < D; d += 16) {
    __m512 qv[G];
    for (int j = 0; j < G; ++j) qv[j] = V::load(qg + j * D + d);
    for (int r = 0; r < R; ++r) {
      before_step(r, d);
      const __m512 kv = V::load(key + r * key_stride + d);
      for (int j = 0; j < G; ++j) dots[j][r] = V::fma(qv[j], kv, dots[j][r]);
    }
  }
}

// score_run's scores for R consecutive keys and kv head g's G query heads,
// the lanes summed R at a time: the same chains and sums, so the same bits.
template <int G, int R, typename KV, bool kDot, typename BeforeStep>
inline void score_tree(const float* qg, const KV* key, int64_t key_stride, int64_t D, float scale, float softcap,
                       float* out, int64_t ctx, BeforeStep before_step) {
  __m512 dots[G][R];
  if constexpr (kDot) {
    dot_chains<G, R>(qg, key, key_stride, D, dots, before_step);
  } else {
    fma_chains<G, R>(qg, key, key_stride, D, dots, before_step);
  }
  for (int j = 0; j < G; ++j) {
    store_sums<R>(dots[j], scale, out + j * ctx);
    soft_cap(out + j * ctx, R, softcap);
  }
}
#endif

// Pass 1 of a work item: sequence b's keys [t_begin, t_end) (within its
// context first..end-1) against the G query heads of each kv head in
// [g0, g1), in slot order (each slot's heads are contiguous; one kv head:
// kKeysAtOnce keys at a time); also prefetches each slot's values and the
// next block's keys into L2. Score row h = (g - g0) * G + j, column
// t - first, row stride end - first. Each score is one chain of FMAs along
// the head dimension, whatever the range or the keys scored beside it: a
// split of the keys between threads leaves the bits alone. kDot: bf16 dot
// products (dot_chains) in place of the FMA chains.
template <int G, typename V, typename KV, bool kDot = false>
void score_keys(const float* q, const KV* kp, const KV* vp, const int64_t* table, int64_t first, int64_t end,
                int64_t t_begin, int64_t t_end, int64_t block_size, int64_t KVH, int64_t D, int64_t g0, int64_t g1,
                float scale, float softcap, float* scores) {
  constexpr int K = kKeysAtOnce<G>;
  const int64_t ctx = end - first;
  for (int64_t t0 = t_begin - t_begin % block_size; t0 < t_end; t0 += block_size) {
    const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, t_end - t0);
    // The next block's keys into L2, one slot per key scored here: blocks lie
    // anywhere in the pool, so the hardware prefetcher cannot run ahead of a
    // block boundary (into L1 instead, or all at the block's start: slower).
    const KV* next_keys = t0 + block_size < t_end ? kp + table[t0 / block_size + 1] * block_size * KVH * D : nullptr;
    // Inlined by force: GCC left this lambda out of line in the avx2 and
    // avx512 builds, and its call per slot made the loop spill and reload
    // vector registers around it; inlined, the eight-lane kernel ran 1.11x
    // (fp32 pool) and 1.45x (fp16) faster from memory on Ice Lake (64
    // sequences, 320 keys; outputs equal).
    auto prefetch = [&](int64_t i) __attribute__((always_inline)) {
      const int64_t row = (base + i) * KVH;
      for (int64_t off = g0 * D * sizeof(KV); off < g1 * D * sizeof(KV); off += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(vp + row * D) + off, _MM_HINT_T1);
        if (next_keys) _mm_prefetch(reinterpret_cast<const char*>(next_keys + i * KVH * D) + off, _MM_HINT_T1);
      }
    };
    int64_t i = std::max<int64_t>(t_begin - t0, 0);
#ifdef KILN_ATTEND_LANES16
    if constexpr (std::is_same_v<V, Lanes16> && kTreeKeys<G> > 0) {
      // The same requests paced through the scoring: before key r's step at
      // head dim d, the line of its slot's values for kv head g that starts
      // there and the next block's key line beside it. Issued at once, R
      // slots' requests (96 lines: 8 bf16 slots of 3 kv heads) stalled the
      // core until the misses drained; paced, 64 sequences of 320 keys ran
      // 1.35-1.41x faster from memory on Zen 4 (docs/benchmarks.md).
      auto prefetch_line = [&](int64_t slot, int64_t g, int64_t d) __attribute__((always_inline)) {
        if (d * sizeof(KV) % 64 != 0) return;
        const int64_t off = (g * D + d) * sizeof(KV);
        _mm_prefetch(reinterpret_cast<const char*>(vp + (base + slot) * KVH * D) + off, _MM_HINT_T1);
        if (next_keys) _mm_prefetch(reinterpret_cast<const char*>(next_keys + slot * KVH * D) + off, _MM_HINT_T1);
      };
      constexpr int R = kTreeKeys<G>;
      for (; i + R <= n; i += R) {
        for (int64_t g = g0; g < g1; ++g) {
          auto before_step = [&](int r, int64_t d) __attribute__((always_inline)) { prefetch_line(i + r, g, d); };
          score_tree<G, R, KV, kDot>(q + g * G * D, kp + ((base + i) * KVH + g) * D, KVH * D, D, scale, softcap,
                                     scores + (g - g0) * G * ctx + t0 + i - first, ctx, before_step);
        }
      }
    }
#endif
    for (; g1 - g0 == 1 && i + K <= n; i += K) {
      for (int k = 0; k < K; ++k) prefetch(i + k);
      score_run<G, K, V, KV, kDot>(q + g0 * G * D, kp + ((base + i) * KVH + g0) * D, KVH * D, D, scale, softcap,
                                   scores + t0 + i - first, ctx);
    }
    for (; i < n; ++i) {
      prefetch(i);
      for (int64_t g = g0; g < g1; ++g)
        score_run<G, 1, V, KV, kDot>(q + g * G * D, kp + ((base + i) * KVH + g) * D, KVH * D, D, scale, softcap,
                                     scores + (g - g0) * G * ctx + t0 + i - first, ctx);
    }
  }
}

// Pass 2 for kv head g and head dimensions [d_begin, d_end) (a multiple of
// S vectors): the G x S output vectors held in registers while the values
// stream by, weighted by the softmaxed score rows `sg` (G rows, stride
// end - first). Every output element is the same chain of FMAs over t in
// order, whatever the batch, the dimension range or the thread split.
// kPrefetch: request the next block's values for this range while weighing
// this one (a split item's values were not prefetched by its own pass 1).
template <int G, int S, typename V, typename KV, bool kPrefetch = false>
void weigh_values(const KV* vp, const int64_t* table, int64_t first, int64_t end, int64_t block_size, int64_t KVH,
                  int64_t D, int64_t g, int64_t d_begin, int64_t d_end, const float* sg, float* out) {
  using Vec = typename V::Vec;
  const int64_t ctx = end - first;
  for (int64_t d = d_begin; d < d_end; d += S * V::kLanes) {
    Vec acc[G][S];
    for (int j = 0; j < G; ++j)
      for (int s = 0; s < S; ++s) acc[j][s] = V::zero();
    for (int64_t t0 = first - first % block_size; t0 < end; t0 += block_size) {
      const int64_t base = table[t0 / block_size] * block_size, n = std::min(block_size, end - t0);
      const bool has_next = kPrefetch && t0 + block_size < end;
      const KV* next = has_next ? vp + (table[t0 / block_size + 1] * block_size * KVH + g) * D + d : nullptr;
      for (int64_t i = std::max<int64_t>(first - t0, 0); i < n; ++i) {
        if (next)
          for (int64_t off = 0; off < S * V::kLanes * static_cast<int64_t>(sizeof(KV)); off += 64)
            _mm_prefetch(reinterpret_cast<const char*>(next + i * KVH * D) + off, _MM_HINT_T0);
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

// One work item: sequence b, kv heads [g0, g1), each with its G query heads:
// all its keys scored, each score row softmaxed, then the values weighed per
// kv head and slice of S vectors of the head dimension (8 lanes: 4 x 8 floats
// where G x 4 accumulators fit (AVX2: fp32 pools only), else 2 x 8; 16 lanes: 4 x 16 where G x 4
// accumulators fit, else 1 x 16), reading the values from L2 where pass 1
// prefetched them.
template <int G, int S, typename V, typename KV, bool kDot = false>
void attend(const float* q, const KV* kp, const KV* vp, const int64_t* table, int64_t first, int64_t end,
            int64_t block_size, int64_t KVH, int64_t D, int64_t g0, int64_t g1, float scale, float softcap,
            std::vector<float>& scores, float* out) {
  const int64_t nh = (g1 - g0) * G, ctx = end - first;
  scores.resize(nh * ctx);
  score_keys<G, V, KV, kDot>(q, kp, vp, table, first, end, first, end, block_size, KVH, D, g0, g1, scale, softcap,
                             scores.data());
  for (int64_t h = 0; h < nh; ++h) softmax(scores.data() + h * ctx, ctx);
  // The AVX2 build on an fp32 pool requests the next block's values into
  // L1 as it weighs a block (with the four slices above, 1.07x on Zen 3
  // from DRAM: docs/benchmarks.md); 16-bit pools and the 16-lane build were
  // tuned without it (fp16 measured 0.93-0.96x with it) and are left so.
  constexpr bool kPrefetchValues = V::kLanes == 8 && std::is_same_v<KV, float>;
  for (int64_t g = g0; g < g1; ++g)
    weigh_values<G, S, V, KV, kPrefetchValues>(vp, table, first, end, block_size, KVH, D, g, 0, D,
                                               scores.data() + (g - g0) * G * ctx, out);
}

template <typename KV>
using AttendFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, float, float, std::vector<float>&, float*);
template <typename KV>
using ScoreFn = void (*)(const float*, const KV*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, int64_t, int64_t, int64_t, int64_t, float, float, float*);
template <typename KV>
using WeighFn = void (*)(const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                         int64_t, const float*, float*);

// Head dimensions per pass 2 item when a sequence's work is split: kSplitSlice
// floats (two AVX2 vectors or one 16-lane vector; D % 16 == 0 always), or
// kSplitSliceWide (8 lanes where `attend` takes four slices): two cache lines
// of each slot's values per item instead of one, 1.07-1.10x at batch 1 on Zen
// 3 (docs/benchmarks.md).
constexpr int64_t kSplitSlice = 16, kSplitSliceWide = 32;

// The kernels for a GQA group size: the whole item, and its two passes for
// split sequences (pass 2 `slice` dimensions at a time). kDot: pass 1 on bf16
// dot products (the avx512_bf16 build, a bf16 pool and bf16 queries).
template <typename KV>
struct GroupKernels {
  AttendFn<KV> attend = nullptr;
  ScoreFn<KV> score = nullptr;
  WeighFn<KV> weigh = nullptr;
  int64_t slice = kSplitSlice;
};

template <typename KV, bool kDot, int... G>
GroupKernels<KV> kernels_for_group(int group, int64_t D, std::integer_sequence<int, G...>) {
  GroupKernels<KV> k;
#ifdef KILN_ATTEND_LANES16
  using V = Lanes16;
  // Four 16-lane slices of outputs per pass where G x 4 accumulators fit (up to 16 of 32 registers).
  const bool wide = D % 64 == 0 && group <= 4;
  ((k.attend = group == G + 1 ? (wide ? attend<G + 1, (G < 4 ? 4 : 1), V, KV, kDot> : attend<G + 1, 1, V, KV, kDot>)
                              : k.attend), ...);
  ((k.weigh = group == G + 1 ? weigh_values<G + 1, kSplitSlice / 16, V, KV, true> : k.weigh), ...);
#else
  static_assert(!kDot, "bf16 dot products: the avx512_bf16 build only");
  using V = Lanes8;
  // Four 8-lane slices of outputs per pass where G x 4 accumulators fit, else two. An fp32 pool's values are
  // FMA memory operands, so the 12 accumulators fit AVX2's 16 registers; a 16-bit pool's are widened into
  // registers first, which only the avx512 builds' 32 registers hold: there four slices ran 1.04-1.12x
  // faster than two on Ice Lake (fp16 and bf16 pools, 1-64 sequences, docs/benchmarks.md). The avx2 build
  // takes two on 16-bit pools (measured no slower than four on Zen 3).
#if KILN_AVX512
  constexpr bool kWide16Bit = true;
#else
  constexpr bool kWide16Bit = false;
#endif
  const bool wide = (std::is_same_v<KV, float> || kWide16Bit) && D % 32 == 0 && group <= 3;
  ((k.attend = group == G + 1 ? (wide ? attend<G + 1, (G < 3 ? 4 : 2), V, KV> : attend<G + 1, 2, V, KV>)
                              : k.attend), ...);
  if (wide) k.slice = kSplitSliceWide;
  ((k.weigh = group == G + 1 ? (wide ? weigh_values<G + 1, kSplitSliceWide / 8, V, KV, true>
                                     : weigh_values<G + 1, kSplitSlice / 8, V, KV, true>)
                             : k.weigh), ...);
#endif
  ((k.score = group == G + 1 ? score_keys<G + 1, V, KV, kDot> : k.score), ...);
  return k;
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

// Fewest keys (a sequence's attended context) for which the split below pays
// for its two extra parallel regions. With pass 1 reading whole slots, a
// split from 48 keys against 256 ran 1.05 / 1.22 / 1.23 / 1.38x at 64 / 128
// / 192 / 250 keys from DRAM (where a decode step finds them: the weights
// stream through L3 between layers) and 0.89-0.98x from L3 (Zen 3, batch 1,
// docs/benchmarks.md). Re-tune: bench/paged_attention.py --batch 1.
// The avx512 and avx512_vnni builds run on Intel Xeons, where the split cost
// more than it saved below ~400 keys: on Ice Lake, one sequence with a 9 MB
// read between calls (a layer's weights), split / not split 1.25x at 48
// keys, 1.14-1.15x at 160, 1.08-1.10x at 256, 1.00-1.02x at 384, 0.94-0.95x
// at 640 (2026-12-07, docs/benchmarks.md). So does the avx512_bf16 build on
// Zen 4 since its pass 1 paces its prefetches: with a 40 MB read between
// calls, 1.20x at 64 keys, 1.25x at 128, 1.07x at 256, 0.93-0.96x at 384-512.
#if KILN_AVX512 || KILN_AVX512_BF16
constexpr int64_t kSplitMinKeys = 384;
#else
constexpr int64_t kSplitMinKeys = 48;
#endif

// Fewer sequences than threads, and their (sequence, kv head) items cannot be
// shared evenly (one sequence's three kv heads on two threads: one thread
// does two, the other waits). Not for more sequences: 3 x 512 keys split ran
// 0.6-0.97x on Zen 3 (why is not established; docs/benchmarks.md).
bool split_pays(const int64_t* lens, int64_t sequences, int64_t items, int64_t threads, int64_t window) {
  if (sequences == 0 || sequences >= threads || items >= 4 * threads || items % threads == 0) return false;
  const int64_t longest = *std::max_element(lens, lens + sequences);
  return (window > 0 ? std::min(longest, window) : longest) >= kSplitMinKeys;
}

// Work split finer than a (sequence, kv head): pass 1 over block-aligned key
// ranges of all kv heads (each thread reads whole slots, in order: 1.18x at
// 300 keys, 1.36x at 1,000 from DRAM on Zen 3, against ranges of one kv
// head), each score row softmaxed whole, pass 2 over slices of head
// dimensions. Every score and output is the chain of FMAs `attend` computes
// (see score_keys, weigh_values): the same bits as unsplit.
template <typename KV, typename Q>
void attend_split(const GroupKernels<KV>& k, const QueryRows<Q>& rows, const KV* kp, const KV* vp,
                  const int64_t* tp, int64_t W, const int64_t* lp, int64_t B, int64_t H, int64_t KVH, int64_t D,
                  int64_t block_size, int64_t window, float scale, float softcap) {
  const int64_t G = H / KVH, threads = at::get_num_threads();
  std::vector<int64_t> first(B), offset(B + 1, 0);  // score rows of sequence b from offset[b], stride ctx
  std::vector<std::vector<float>> q32(B), out32(B);
  std::vector<const float*> qs(B);
  std::vector<float*> outs(B);
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    first[b] = window > 0 ? std::max<int64_t>(lp[b] - window, 0) : 0;
    offset[b + 1] = offset[b] + H * (lp[b] - first[b]);
    keys += lp[b] - first[b];
    qs[b] = rows.widened(b, q32[b]);
    outs[b] = rows.staging(b, out32[b]);
  }
  std::vector<float> scores(offset[B]);
  // Pass 1 items (sequence, key range): about four per thread.
  const int64_t per_item = std::max<int64_t>((keys / (4 * threads) + block_size - 1) / block_size, 1) * block_size;
  struct KeyRange { int64_t b, t0, t1; };
  std::vector<KeyRange> ranges;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t0 = first[b]; t0 < lp[b]; t0 = std::min(lp[b], (t0 / per_item + 1) * per_item))
      ranges.push_back({b, t0, std::min(lp[b], (t0 / per_item + 1) * per_item)});
  at::parallel_for(0, static_cast<int64_t>(ranges.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const KeyRange& r = ranges[i];
      k.score(qs[r.b], kp, vp, tp + r.b * W, first[r.b], lp[r.b], r.t0, r.t1, block_size, KVH, D, 0, KVH, scale,
              softcap, scores.data() + offset[r.b]);
    }
  });
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, ctx = lp[b] - first[b];
      softmax(scores.data() + offset[b] + (i % H) * ctx, ctx);
    }
  });
  // Pass 2 items (sequence, kv head, slice of head dimensions). Both passes
  // keep parallel_for's equal contiguous shares (not guided_for): their items
  // cost the same, and neighbouring slices share the value rows' cache lines,
  // which claims would split between the threads (guided_for ran this path
  // 1.1x slower at one sequence of 1,500 keys on Ice Lake).
  const int64_t slices = D / k.slice;
  at::parallel_for(0, B * KVH * slices, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (KVH * slices), g = i / slices % KVH, d = i % slices * k.slice;
      const int64_t ctx = lp[b] - first[b];
      k.weigh(vp, tp + b * W, first[b], lp[b], block_size, KVH, D, g, d, d + k.slice,
              scores.data() + offset[b] + g * G * ctx, outs[b]);
    }
  });
  for (int64_t b = 0; b < B; ++b) rows.store(b, out32[b], 0, H * D);
}

#if KILN_AVX512_BF16
constexpr bool kHasBf16Dot = true;
#else
constexpr bool kHasBf16Dot = false;
#endif

// Whether pass 1 can score on bf16 dot products (dot_chains): a bf16 pool
// and bf16 queries in the build that has them (and 32 head dims at a time).
template <typename KV, typename Q>
constexpr bool kBf16Dot = kHasBf16Dot && std::is_same_v<KV, at::BFloat16> && std::is_same_v<Q, at::BFloat16>;

template <typename KV, typename Q>
void attend_all(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& tables,
                const at::Tensor& lens, int64_t block_size, float scale, int64_t window, float softcap,
                at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_pool.size(1), W = tables.size(1);
  const int64_t group = H / KVH, threads = at::get_num_threads();
  const GroupKernels<KV> k = kBf16Dot<KV, Q> && D % 32 == 0
      ? kernels_for_group<KV, kBf16Dot<KV, Q>>(group, D, std::make_integer_sequence<int, kMaxGroup>{})
      : kernels_for_group<KV, false>(group, D, std::make_integer_sequence<int, kMaxGroup>{});
  const QueryRows<Q> rows{q.const_data_ptr<Q>(), out.mutable_data_ptr<Q>(), q.stride(0), H * D};
  const KV* kp = k_pool.const_data_ptr<KV>();
  const KV* vp = v_pool.const_data_ptr<KV>();
  const int64_t* tp = tables.const_data_ptr<int64_t>();
  const int64_t* lp = lens.const_data_ptr<int64_t>();
  // A work item is one sequence with all its kv heads. With fewer sequences
  // than threads, items are (sequence, kv head) instead, and split finer
  // still where those cannot be shared evenly.
  const bool per_head = B < threads;
  const int64_t items = per_head ? B * KVH : B;
  if (split_pays(lp, B, items, threads, window)) {
    attend_split<KV, Q>(k, rows, kp, vp, tp, W, lp, B, H, KVH, D, block_size, window, scale, softcap);
    return;
  }
  // Claimed longest first: decode rows come sorted by context (runner/inputs.py),
  // so items are taken from the end, and the last claims, one item each, are
  // the shortest sequences. Which thread computes an item changes no bits.
  kiln_parallel::guided_for(items, 1, [&] {
    return [&, scores = std::vector<float>(), q32 = std::vector<float>(), out32 = std::vector<float>()](
               int64_t begin, int64_t end) mutable {
      for (int64_t j = begin; j < end; ++j) {
        const int64_t i = items - 1 - j;
        const int64_t b = per_head ? i / KVH : i, g0 = per_head ? i % KVH : 0, g1 = per_head ? g0 + 1 : KVH;
        const int64_t first = window > 0 ? std::max<int64_t>(lp[b] - window, 0) : 0;
        k.attend(rows.widened(b, q32), kp, vp, tp + b * W, first, lp[b], block_size, KVH, D, g0, g1, scale, softcap,
                 scores, rows.staging(b, out32));
        rows.store(b, out32, g0 * group * D, g1 * group * D);
      }
    };
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
