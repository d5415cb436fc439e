// Causal prefill attention for bf16 q, k and v on AVX512_BF16 (the
// avx512_bf16 build; prefill_attention.cpp sends bf16 chunks here). The
// fp32 path's tiling, with both products as bf16 dot products (vdpbf16ps:
// the two products of a bf16 pair added into an fp32 lane), which do twice
// the work of an fp32 FMA per instruction: that path's loops ran at the FMA
// ports' limit (~65% of prefill attention's time on Zen 4).
//   scores = q . k: bf16 values multiply exactly; head dims are summed in
//     pairs into fp32 (another order than the fp32 path's);
//   out = p . v: the softmax weights are rounded to bf16 first, as torch's
//     CPU flash attention (SDPA) rounds them for bf16 operands, then summed
//     in pairs of keys into fp32; the output is rounded once.
// Layouts, built once per call and kv head (L32 = L rounded up to 32, zeros past L):
//   keys   [L32 / 16][D / 2][16] u32: vector (block b, pair j) holds head dims
//          2j, 2j + 1 of keys 16b .. 16b + 15;
//   values [L32 / 2][D / 16][32] u16: vector (pair c, chunk m) holds
//          v[2c][16m + e], v[2c + 1][16m + e] at words 2e, 2e + 1.
// A row's result depends only on its own keys: its scores sum a key's head
// dims in one fixed order, and its weighted sum runs over key pairs from key
// 0 (a window's tile start) in order, with zero weights outside its range,
// so neither the tile nor the thread split changes its bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "parallel_chunks.h"
#include "prefill_attention.h"
#include "simd.h"
#include "simd512.h"

// Named around the anonymous one: the build compiles every source as one unit, beside the fp32 path's names.
namespace kiln_prefill_bf16 {
namespace {

using kiln_prefill::Geometry;
using bf16 = c10::BFloat16;

constexpr int64_t kTileRows = 16;   // query rows per work item
constexpr int64_t kKeyBlock = 16;   // keys per score vector
constexpr int64_t kScoreKeys = 32;  // keys per score pass (two vectors)
constexpr int64_t kScoreVecs = 12;  // query vectors per score pass: 12 x 2 accumulators + 2 keys + a broadcast
constexpr int64_t kValueVecs = 6;   // query vectors per value pass: 6 x 4 accumulators + 4 values + a broadcast
constexpr int64_t kValueChunks = 4;  // 16-dim chunks per value pass

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

uint32_t pair_at(const bf16* p) {  // two bf16 as one u32 (the first in the low half), any alignment
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

__m512bh bh(__m512i v) { return (__m512bh)v; }

// Keys t0 .. t0 + 15 of kv head g: out[j][e] = (k[t0 + e][2j], k[t0 + e][2j + 1]).
void pack_key_block(const Geometry& s, const bf16* k, int64_t k_stride, int64_t g, int64_t t0, uint32_t* out) {
  const int64_t pairs = s.D / 2;
  for (int64_t e = 0; e < kKeyBlock; ++e) {
    if (t0 + e >= s.L) {
      for (int64_t j = 0; j < pairs; ++j) out[j * kKeyBlock + e] = 0;
      continue;
    }
    const bf16* row = k + (t0 + e) * k_stride + g * s.D;
    for (int64_t j = 0; j < pairs; ++j) out[j * kKeyBlock + e] = pair_at(row + 2 * j);
  }
}

// Keys 2c and 2c + 1 of kv head g: out[m][2e + h] = v[2c + h][16m + e].
void pack_value_pair(const Geometry& s, const bf16* v, int64_t v_stride, int64_t g, int64_t c, uint16_t* out) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                           8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(kInterleave);
  auto half = [&](int64_t t, int64_t m) {
    return t < s.L ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + t * v_stride + g * s.D + 16 * m))
                   : _mm256_setzero_si256();
  };
  for (int64_t m = 0; m < s.D / 16; ++m) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(half(2 * c, m)), half(2 * c + 1, m), 1);
    _mm512_storeu_si512(out + m * 32, _mm512_permutexvar_epi16(order, both));
  }
}

// scores[i][0..32) = scale * (q_i . key) for kScoreVecs query vectors (qp: D/2 pairs each) and the 32 keys
// of blocks kb, kb + 1: per pair of head dims, two key loads and kScoreVecs broadcasts feed 24 vdpbf16ps.
inline void score_pass(const uint32_t* qp, int64_t pairs, const uint32_t* kb, float scale, float* scores,
                       int64_t stride) {
  __m512 acc[kScoreVecs][2];
  for (auto& a : acc) a[0] = a[1] = _mm512_setzero_ps();
  const uint32_t* kb1 = kb + pairs * kKeyBlock;
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh key0 = bh(_mm512_loadu_si512(kb + j * kKeyBlock)), key1 = bh(_mm512_loadu_si512(kb1 + j * kKeyBlock));
    for (int64_t i = 0; i < kScoreVecs; ++i) {
      const __m512bh qv = bh(_mm512_set1_epi32(static_cast<int>(qp[i * pairs + j])));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], qv, key0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], qv, key1);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < kScoreVecs; ++i) {
    _mm512_storeu_ps(scores + i * stride, _mm512_mul_ps(acc[i][0], vscale));
    _mm512_storeu_ps(scores + i * stride + kKeyBlock, _mm512_mul_ps(acc[i][1], vscale));
  }
}

// acc[i][z] = sum_c p_i[c] * v[c][16 (m + z) ..) over key pairs [0, n_pairs) for kValueVecs weight rows p
// (bf16, stride p_stride) and NZ 16-dim chunks starting at chunk m (vp points at pair 0, chunk m).
template <int NZ>
inline void weigh_values(const uint16_t* p, int64_t p_stride, const uint16_t* vp, int64_t chunks, int64_t n_pairs,
                         __m512 acc[kValueVecs][kValueChunks]) {
  for (int64_t i = 0; i < kValueVecs; ++i)
    for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_setzero_ps();
  for (int64_t c = 0; c < n_pairs; ++c) {
    __m512bh val[NZ];
    for (int z = 0; z < NZ; ++z) val[z] = bh(_mm512_loadu_si512(vp + (c * chunks + z) * 32));
    for (int64_t i = 0; i < kValueVecs; ++i) {
      uint32_t w;
      std::memcpy(&w, p + i * p_stride + 2 * c, sizeof w);
      const __m512bh wv = bh(_mm512_set1_epi32(static_cast<int>(w)));
      for (int z = 0; z < NZ; ++z) acc[i][z] = _mm512_dpbf16_ps(acc[i][z], wv, val[z]);
    }
  }
}

struct Scratch {
  std::vector<uint32_t> q;    // [nvp][D/2] query pairs, zero rows past the tile's vectors
  std::vector<float> scores;  // [nvp][cols]
  std::vector<uint16_t> p;    // [nvp][cols] bf16 weights
};

// Query rows [r0, r1) of kv head g (query vector i = (r - r0) * G + j is head g * G + j of row r).
void attend_tile(const Geometry& s, const bf16* q, int64_t q_stride, const uint32_t* keys, const uint16_t* values,
                 int64_t g, int64_t r0, int64_t r1, Scratch& w, bf16* out) {
  const int64_t pairs = s.D / 2, chunks = s.D / 16;
  const int64_t nv = (r1 - r0) * s.G, nvp = round_up(nv, kScoreVecs);
  const int64_t k0 = s.first_key(r0) / kScoreKeys * kScoreKeys, k1 = round_up(s.end_key(r1 - 1), kScoreKeys);
  const int64_t cols = k1 - k0;  // score column c is key k0 + c
  w.q.assign(nvp * pairs, 0);
  for (int64_t i = 0; i < nv; ++i)
    std::memcpy(w.q.data() + i * pairs, q + (r0 + i / s.G) * q_stride + (g * s.G + i % s.G) * s.D, s.D * sizeof(bf16));
  w.scores.resize(nvp * cols);
  for (int64_t b = k0; b < k1; b += kScoreKeys)
    for (int64_t i = 0; i < nvp; i += kScoreVecs)
      score_pass(w.q.data() + i * pairs, pairs, keys + b / kKeyBlock * pairs * kKeyBlock, s.scale,
                 w.scores.data() + i * cols + (b - k0), cols);
  w.p.assign(nvp * cols, 0);
  for (int64_t i = 0; i < nv; ++i) {  // each row's softmax over its visible keys, rounded to bf16; zero elsewhere
    float* row = w.scores.data() + i * cols;
    const int64_t r = r0 + i / s.G, lo = s.first_key(r) - k0, hi = s.end_key(r) - k0;
    if (s.softcap > 0)
      for (int64_t c = lo; c < hi; ++c) row[c] = std::tanh(row[c] / s.softcap) * s.softcap;  // as transformers caps
    kiln_simd::softmax(row + lo, hi - lo);
    std::fill(row, row + lo, 0.0f);
    std::fill(row + hi, row + cols, 0.0f);
    bf16* prow = reinterpret_cast<bf16*>(w.p.data() + i * cols);
    for (int64_t c = 0; c < cols; c += 16) kiln_simd512::store16(prow + c, _mm512_loadu_ps(row + c));
  }
  const int64_t n_pairs = (s.end_key(r1 - 1) - k0 + 1) / 2;
  const uint16_t* vbase = values + k0 / 2 * chunks * 32;
  for (int64_t i0 = 0; i0 < nv; i0 += kValueVecs)
    for (int64_t m = 0; m < chunks; m += kValueChunks) {
      __m512 acc[kValueVecs][kValueChunks];
      const int64_t nz = std::min(kValueChunks, chunks - m);
      const uint16_t* pi = w.p.data() + i0 * cols;
      switch (nz) {
        case 4: weigh_values<4>(pi, cols, vbase + m * 32, chunks, n_pairs, acc); break;
        case 3: weigh_values<3>(pi, cols, vbase + m * 32, chunks, n_pairs, acc); break;
        case 2: weigh_values<2>(pi, cols, vbase + m * 32, chunks, n_pairs, acc); break;
        default: weigh_values<1>(pi, cols, vbase + m * 32, chunks, n_pairs, acc); break;
      }
      for (int64_t i = i0; i < std::min(i0 + kValueVecs, nv); ++i) {
        bf16* o = out + ((r0 + i / s.G) * s.H + g * s.G + i % s.G) * s.D + 16 * m;
        for (int64_t z = 0; z < nz; ++z) kiln_simd512::store16(o + 16 * z, acc[i - i0][z]);
      }
    }
}

void attend_chunk(const Geometry& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out) {
  const int64_t L32 = round_up(s.L, kScoreKeys), pairs = s.D / 2, chunks = s.D / 16;
  const int64_t key_words = L32 * pairs, value_words = L32 / 2 * chunks * 32;  // per kv head
  // Uninitialized on purpose: every block up to L32 is written (zeros past L).
  const std::unique_ptr<uint32_t[]> keys(new uint32_t[s.KVH * key_words]);
  const std::unique_ptr<uint16_t[]> values(new uint16_t[s.KVH * value_words]);
  const bf16* kp = k.const_data_ptr<bf16>();
  const bf16* vp = v.const_data_ptr<bf16>();
  const int64_t blocks = L32 / kKeyBlock;
  at::parallel_for(0, s.KVH * blocks, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t g = i / blocks, b = i % blocks;
      pack_key_block(s, kp, k.stride(0), g, b * kKeyBlock, keys.get() + g * key_words + b * pairs * kKeyBlock);
      for (int64_t c = b * kKeyBlock / 2; c < (b + 1) * kKeyBlock / 2; ++c)
        pack_value_pair(s, vp, v.stride(0), g, c, values.get() + g * value_words + c * chunks * 32);
    }
  });
  const int64_t tiles = (s.Q + kTileRows - 1) / kTileRows;
  const bf16* qp = q.const_data_ptr<bf16>();
  bf16* op = out.mutable_data_ptr<bf16>();
  // Later tiles see more keys: threads claim them last tile first
  // (guided_for), so the last claims are the shortest.
  kiln_parallel::guided_for(tiles * s.KVH, 1, [&] {
    return [&, w = Scratch()](int64_t i0, int64_t i1) mutable {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t tile = tiles - 1 - i / s.KVH, g = i % s.KVH;
        const int64_t r0 = tile * kTileRows, r1 = std::min(r0 + kTileRows, s.Q);
        attend_tile(s, qp, q.stride(0), keys.get() + g * key_words, values.get() + g * value_words, g, r0, r1, w, op);
      }
    };
  });
}

}  // namespace
}  // namespace kiln_prefill_bf16

void kiln_prefill::attend_chunk_bf16(const Geometry& s, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     at::Tensor& out) {
  kiln_prefill_bf16::attend_chunk(s, q, k, v, out);
}
