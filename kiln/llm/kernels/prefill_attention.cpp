// Causal attention of one prefill chunk for CPU: q [Q, H, D] over keys and
// values [L, KVH, D] whose last Q rows are the chunk's own (L - Q cached
// tokens before them). Query row r sees keys up to L - Q + r, and with a
// sliding window only its last `window` of them; `softcap` > 0 soft-caps the
// scores (Gemma 2). fp32, bf16 or fp16 operands of one dtype; the arithmetic
// is fp32 (16-bit values widen exactly) and the output takes q's dtype,
// rounded once, as SDPA rounds it. In the avx512_bf16 build, bf16 operands
// go to prefill_attention_bf16.cpp instead (bf16 dot products, twice the rate).
//
// torch's CPU flash attention runs these shapes (D = 64, hundreds of rows)
// at 40-55 GFLOP/s on two Zen 4 cores, a seventh of what the projections
// around it reach: in a bf16 offline run it was 29% of prefill time. Here
// the work is register-tiled instead:
//   1. keys are widened and transposed once per call into rows of 16 keys
//      ([D][16] floats), values widened into [L][D] rows;
//   2. a work item is 16 query rows of one kv head (all G query heads of it):
//      scores for 6 query vectors x 16 keys per pass (12 accumulators, two
//      key vectors, query elements broadcast), each row's softmax over its
//      visible keys (the decode kernel's softmax), then 6 query vectors x 16
//      head dims of output per pass over the values.
// Every FMA does 8 useful products (16 in both AVX-512 builds, which pass
// 12 query vectors over 32 keys, or 32 head dims, at a time: 24 accumulators
// of their 32 registers; on Ice Lake 1.20-1.29x the eight-lane passes at
// 300-2,048 tokens), with no horizontal sums: every
// score is one chain of FMAs over the head dims, every output one over the
// keys, so the vector width changes no bits. Results agree
// with SDPA to float rounding (a different summation order); a row's result
// depends only on its own keys, never on the thread split.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "kernels.h"
#include "parallel_chunks.h"
#include "prefill_attention.h"
#include "lanes.h"
#include "simd.h"
// Sixteen-lane passes in both AVX-512 builds (AVX-512F only).
#ifdef KILN_LANES16
#define KILN_PREFILL_LANES16 1
#endif

namespace {

using kiln_simd::load8;
using kiln_simd::softmax;
using kiln_simd::store8f;
using kiln_simd::transpose8;

using kiln_prefill::Geometry;

// The vector a pass computes on (lanes.h): 8 fp32 lanes, or 16 in both AVX-512 builds.
#ifdef KILN_PREFILL_LANES16
using PassLanes = kiln_lanes::Lanes16;
#else
using PassLanes = kiln_lanes::Lanes8;
#endif

constexpr int64_t kTileRows = 16;  // query rows per work item
// Query vectors per pass: kScoreVecs x 2 accumulators + 2 key (value) vectors + a broadcast fill the
// registers (16 in the AVX2 build, 32 with AVX-512).
constexpr int64_t kScoreVecs = PassLanes::kLanes == 16 ? 12 : 6;
constexpr int64_t kValueVecs = kScoreVecs;
// Keys scored and head dimensions weighed per pass: two vectors.
constexpr int64_t kPassKeys = 2 * PassLanes::kLanes, kPassDims = 2 * PassLanes::kLanes;

// 8-key blocks of a kv head, a whole number of passes.
int64_t key_blocks(const Geometry& s) { return (s.L + kPassKeys - 1) / kPassKeys * (kPassKeys / 8); }

// Keys of kv head g, block b (keys 8b..8b+7, zeros past L) into the kv head's
// transposed keys kt; values -> vf[L][D] rows, fp32. Blocks b and b + 1 (b
// even) share [D][16] rows: lanes 0-7 block b's keys, 8-15 block b + 1's
// (one 16-lane vector, or the AVX2 build's two 8-lane ones, per head dim).
template <typename T>
void widen_block(const Geometry& s, const T* k, int64_t k_stride, const T* v, int64_t v_stride, int64_t g, int64_t b,
                 float* kt, float* vf) {
  const int64_t t0 = b * 8, n = std::min<int64_t>(8, s.L - t0);
  float* pair = kt + (b / 2) * s.D * 16 + (b % 2) * 8;
  for (int64_t d = 0; d < s.D; d += 8) {
    __m256 r[8];
    for (int64_t j = 0; j < 8; ++j) r[j] = j < n ? load8(k + (t0 + j) * k_stride + g * s.D + d) : _mm256_setzero_ps();
    transpose8(r);
    for (int i = 0; i < 8; ++i) _mm256_storeu_ps(pair + (d + i) * 16, r[i]);
  }
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < s.D; d += 8) _mm256_storeu_ps(vf + (t0 + j) * s.D + d, load8(v + (t0 + j) * v_stride + g * s.D + d));
}

// Key vector j (keys j kLanes ..) of a pass at head dim d: keys lie in [D][16]
// rows of 16 (kt: the pass's first row), so an 8-lane vector is half a row.
inline const float* pass_keys(const float* kt, int64_t j, int64_t d, int64_t D) {
  constexpr int64_t lanes = PassLanes::kLanes;
  return kt + (j * lanes / 16) * D * 16 + d * 16 + j * lanes % 16;
}

// scores[i][0..kPassKeys) = scale * (q_i . key) for kScoreVecs query vectors q (rows of D floats) and a
// pass's keys (kt): per head dim, two key loads and kScoreVecs broadcasts feed 2 kScoreVecs FMAs. Each
// score is one chain of FMAs over the head dims in order, whatever the vector width.
inline void score_blocks(const float* q, const float* kt, int64_t D, float scale, float* scores, int64_t score_stride) {
  using V = PassLanes;
  V::Vec acc[kScoreVecs][2];
  for (int64_t i = 0; i < kScoreVecs; ++i) acc[i][0] = acc[i][1] = V::zero();
  for (int64_t d = 0; d < D; ++d) {
    const V::Vec key0 = V::load(pass_keys(kt, 0, d, D)), key1 = V::load(pass_keys(kt, 1, d, D));
    for (int64_t i = 0; i < kScoreVecs; ++i) {
      const V::Vec qv = V::set1(q[i * D + d]);
      acc[i][0] = V::fma(qv, key0, acc[i][0]);
      acc[i][1] = V::fma(qv, key1, acc[i][1]);
    }
  }
  const V::Vec vscale = V::set1(scale);
  for (int64_t i = 0; i < kScoreVecs; ++i)
    for (int j = 0; j < 2; ++j) V::store(scores + i * score_stride + j * V::kLanes, V::mul(acc[i][j], vscale));
}

// out_i[0..NV kLanes) = sum_c p_i[c] * vf[c][0..NV kLanes) for kValueVecs weight rows p (stride
// p_stride) over n keys: each output one chain of FMAs over the keys in order.
template <int NV>
inline void weigh_values(const float* p, int64_t p_stride, const float* vf, int64_t D, int64_t n,
                         PassLanes::Vec acc[][2]) {
  using V = PassLanes;
  for (int64_t i = 0; i < kValueVecs; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = V::zero();
  for (int64_t c = 0; c < n; ++c) {
    V::Vec v[NV];
    for (int j = 0; j < NV; ++j) v[j] = V::load(vf + c * D + j * V::kLanes);
    for (int64_t i = 0; i < kValueVecs; ++i) {
      const V::Vec w = V::set1(p[i * p_stride + c]);
      for (int j = 0; j < NV; ++j) acc[i][j] = V::fma(w, v[j], acc[i][j]);
    }
  }
}

// Head dims [d, d + kPassDims) of the values; sixteen lanes: the last 16 of a D that is an odd multiple of 16.
inline void weigh_pass(const float* p, int64_t p_stride, const float* vf, int64_t D, int64_t d, int64_t n,
                       PassLanes::Vec acc[][2]) {
  if (d + kPassDims <= D)
    weigh_values<2>(p, p_stride, vf + d, D, n, acc);
  else
    weigh_values<1>(p, p_stride, vf + d, D, n, acc);
}

// Query rows [r0, r1) of kv head g (query vector i = (r - r0) * G + j is head g * G + j of row r).
template <typename T>
void attend_tile(const Geometry& s, const T* q, int64_t q_stride, const float* kt, const float* vf, int64_t g,
                 int64_t r0, int64_t r1, std::vector<float>& qf, std::vector<float>& scores, T* out) {
  const int64_t nv = (r1 - r0) * s.G, nvp = (nv + kScoreVecs - 1) / kScoreVecs * kScoreVecs;
  constexpr int64_t pass_blocks = kPassKeys / 8;  // 8-key blocks scored per pass
  const int64_t b0 = s.first_key(r0) / kPassKeys * pass_blocks;
  const int64_t b1 = (s.end_key(r1 - 1) + kPassKeys - 1) / kPassKeys * pass_blocks;
  const int64_t k0 = b0 * 8, cols = (b1 - b0) * 8;  // score column c is key k0 + c
  qf.assign(nvp * s.D, 0.0f);
  for (int64_t i = 0; i < nv; ++i) {
    const T* qi = q + (r0 + i / s.G) * q_stride + (g * s.G + i % s.G) * s.D;
    for (int64_t d = 0; d < s.D; d += 8) _mm256_storeu_ps(qf.data() + i * s.D + d, load8(qi + d));
  }
  scores.resize(nvp * cols);
  for (int64_t b = b0; b < b1; b += pass_blocks)
    for (int64_t i = 0; i < nvp; i += kScoreVecs)
      score_blocks(qf.data() + i * s.D, kt + b * s.D * 8, s.D, s.scale, scores.data() + i * cols + (b - b0) * 8, cols);
  for (int64_t i = 0; i < nvp; ++i) {  // each row's softmax over its visible keys; zero weight elsewhere
    float* row = scores.data() + i * cols;
    const int64_t r = r0 + i / s.G;
    const int64_t lo = i < nv ? s.first_key(r) - k0 : cols, hi = i < nv ? s.end_key(r) - k0 : cols;
    if (s.softcap > 0)
      for (int64_t c = lo; c < hi; ++c) row[c] = std::tanh(row[c] / s.softcap) * s.softcap;  // as transformers caps
    if (hi > lo) softmax(row + lo, hi - lo);
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + cols, 0.0f);
  }
  const int64_t n = s.end_key(r1 - 1) - k0;
  for (int64_t i0 = 0; i0 < nv; i0 += kValueVecs)
    for (int64_t d = 0; d < s.D; d += kPassDims) {  // D % 16 == 0: a last pass of 16 dims has one vector
      PassLanes::Vec acc[kValueVecs][2];
      weigh_pass(scores.data() + i0 * cols, cols, vf + k0 * s.D, s.D, d, n, acc);
      for (int64_t i = i0; i < std::min(i0 + kValueVecs, nv); ++i) {
        T* o = out + ((r0 + i / s.G) * s.H + g * s.G + i % s.G) * s.D + d;
        PassLanes::store(o, acc[i - i0][0]);
        if (d + kPassDims <= s.D) PassLanes::store(o + kPassDims / 2, acc[i - i0][1]);
      }
    }
}

template <typename T>
void attend_chunk(const Geometry& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  const int64_t nb = key_blocks(s);
  // Uninitialized on purpose (no memset of up to a few MB per layer): every key
  // block is written (zeros past L), and no value row past L is ever read.
  const std::unique_ptr<float[]> kt(new float[s.KVH * nb * 8 * s.D]), vf(new float[s.KVH * nb * 8 * s.D]);
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  at::parallel_for(0, s.KVH * nb, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / nb, b = i % nb;
      widen_block(s, kp, k.stride(0), vp, v.stride(0), g, b, kt.get() + g * nb * 8 * s.D,
                  vf.get() + g * nb * 8 * s.D);
    }
  });
  const int64_t tiles = (s.Q + kTileRows - 1) / kTileRows;
  const T* qp = q.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  // Later tiles see more keys: threads claim them last tile first
  // (guided_for), so the last claims are the shortest.
  kiln_parallel::guided_for(tiles * s.KVH, 1, [&] {
    return [&, qf = std::vector<float>(), scores = std::vector<float>()](int64_t i0, int64_t i1) mutable {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t tile = tiles - 1 - i / s.KVH, g = i % s.KVH;
        const int64_t r0 = tile * kTileRows, r1 = std::min(r0 + kTileRows, s.Q);
        attend_tile<T>(s, qp, q.stride(0), kt.get() + g * nb * 8 * s.D, vf.get() + g * nb * 8 * s.D, g, r0, r1, qf,
                       scores, op);
      }
    };
  });
}

// Rows [T, N, D] with each row's N x D values contiguous (any row stride).
at::Tensor rows_packed(const at::Tensor& t) {
  return t.stride(2) == 1 && t.stride(1) == t.size(2) ? t : t.contiguous();
}

at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, double scale,
                             int64_t window, double softcap) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.sizes() == k_in.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(q_in.scalar_type() == k_in.scalar_type() && v_in.scalar_type() == k_in.scalar_type(),
              "prefill_attention: q, k and v of one dtype");
  const at::ScalarType dtype = q_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "prefill_attention: float32, bfloat16 or float16 operands");
  TORCH_CHECK(q_in.device().is_cpu() && k_in.device().is_cpu() && v_in.device().is_cpu(), "prefill_attention: CPU");
  const at::Tensor q = rows_packed(q_in), k = rows_packed(k_in), v = rows_packed(v_in);
  const int64_t Q = q.size(0), H = q.size(1), D = q.size(2), L = k.size(0), KVH = k.size(1);
  TORCH_CHECK(k.size(2) == D && D % 16 == 0 && H % KVH == 0, "prefill_attention: head layout");
  TORCH_CHECK(L >= Q, "prefill_attention: the keys must include the chunk's own ", Q, " rows (got ", L, ")");
  TORCH_CHECK(window >= 0 && softcap >= 0 && scale > 0, "prefill_attention: scale > 0, window and softcap >= 0");
  at::Tensor out = at::empty({Q, H, D}, q.options());
  if (Q == 0) return out;
  const Geometry s{Q, L, H, KVH, D, H / KVH, window, static_cast<float>(scale), static_cast<float>(softcap)};
  switch (dtype) {
    case at::kFloat: attend_chunk<float>(s, q, k, v, out); break;
#if KILN_AVX512_BF16
    case at::kBFloat16: kiln_prefill::attend_chunk_bf16(s, q, k, v, out); break;
#else
    case at::kBFloat16: attend_chunk<c10::BFloat16>(s, q, k, v, out); break;
#endif
    default: attend_chunk<c10::Half>(s, q, k, v, out); break;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int window=0, float softcap=0.0) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("prefill_attention", prefill_attention); }
