// One row of int4 group-wise weights (linear_f32.cpp's Int4Problem layout)
// widened to fp32 in memory: w = fma(q, scale, min) lane by lane, the very
// operation the int4 kernel applies in registers, so the widened row is the
// one the kernel multiplies by. Used by dequantize_w4 (a whole weight, for
// oneDNN at prefill sizes) and by linear_w4 above the narrow sizes (a tile of
// rows at a time, reused by every x row).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "linear_tiling.h"
#include "parallel_chunks.h"

namespace kiln_int4 {

// An int4 group-wise weight as every kernel taking one checks it (`name`
// heads the message): codes uint8 CPU [N, K/2], scale_min fp16 or fp32 CPU
// [N, K/G, 2], G a multiple of 32 dividing K, K a multiple of 64.
struct Weight {
  at::Tensor codes, scale_min;  // contiguous
  int64_t N, K, G;

  // f(params), params `const float*` or `const uint16_t*` (fp16 bits) by scale_min's dtype.
  template <typename F>
  void with_params(F&& f) const {
    if (scale_min.scalar_type() == at::kFloat)
      f(scale_min.const_data_ptr<float>());
    else
      f(reinterpret_cast<const uint16_t*>(scale_min.const_data_ptr<at::Half>()));
  }
};

inline Weight checked_weight(const at::Tensor& codes, const at::Tensor& scale_min, int64_t G, const char* name) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.device().is_cpu(), name,
              ": uint8 CPU codes [N, K/2] required");
  const int64_t N = codes.size(0), K = codes.size(1) * 2;
  TORCH_CHECK(G > 0 && G % 32 == 0 && K % G == 0 && K % 64 == 0, name,
              ": group_size must be a multiple of 32 dividing K, and K a multiple of 64");
  const at::ScalarType params = scale_min.scalar_type();
  TORCH_CHECK((params == at::kFloat || params == at::kHalf) && scale_min.device().is_cpu() &&
                  scale_min.numel() == N * (K / G) * 2,
              name, ": fp16 or fp32 CPU scale_min [N, K/G, 2] required");
  return {codes.contiguous(), scale_min.contiguous(), N, K, G};
}

// The group of each run of 64 weights along a row, walked without dividing
// (the inner loops had two 64-bit divisions per run, b / G and (b + 32) / G;
// on Zen 4 they overlapped the vector work: no measurable change). `group`
// is the group of the run's first weight; `split()`: its second half
// (weights b + 32 ..) starts the next group (G = 32, or an odd multiple of 32 at some b).
struct RunGroups {
  int64_t G, group = 0, end;  // group holds weights [end - G, end)
  explicit RunGroups(int64_t G) : G(G), end(G) {}
  bool split(int64_t b) const { return b + 32 >= end; }
  void next_run(int64_t b) {  // b: the next run's first weight
    while (b >= end) ++group, end += G;
  }
};

// (scale, min) of group g of a row as floats (fp16 through F16C: both builds have it).
template <typename P>
inline void group_params(const P* p, float& scale, float& min) {
  if constexpr (std::is_same_v<P, float>) {
    scale = p[0], min = p[1];
  } else {
    scale = _cvtsh_ss(p[0]);
    min = _cvtsh_ss(p[1]);
  }
}

inline void store8(float* out, __m256 w) { _mm256_storeu_ps(out, w); }

// Eight bf16 (as uint16) rounded to nearest even, as torch's .to(torch.bfloat16)
// rounds finite values (widened weights are finite): AVX2 only, so both builds have it.
inline void store8(uint16_t* out, __m256 w) {
  const __m256i bits = _mm256_castps_si256(w);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works within 128-bit lanes: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded, rounded), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

// Runs of 64 weights as eight 32-bit words, word j holding weight 8s + j of
// the run in bits 4s .. 4s+3, so nibble s of all eight words is weights
// 8s .. 8s+7: one shift, one mask, one convert, one FMA, one store (O: float,
// or uint16_t for bf16 rounded from that float).
template <typename P, typename O>
inline void widen_row(const uint8_t* codes, const P* params, O* out, int64_t K, int64_t G) {
  const __m256i low4 = _mm256_set1_epi32(0x0F);
  const int64_t halves_per_group = G / 32;  // G is a multiple of 32: a half-run never straddles groups
  int64_t left = 0;                          // halves left in the current group
  __m256 scale, min;
  for (int64_t b = 0; b < K; b += 64) {
    const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b / 2));
    for (int half = 0; half < 2; ++half) {  // weights 32 half .. 32 half + 31: nibbles s = 4 half .. 4 half + 3
      if (left == 0) {
        float sc, mn;
        group_params(params, sc, mn);
        params += 2;
        scale = _mm256_set1_ps(sc), min = _mm256_set1_ps(mn), left = halves_per_group;
      }
      --left;
      for (int s = 4 * half; s < 4 * half + 4; ++s) {
        const __m256i q = _mm256_and_si256(_mm256_srli_epi32(words, 4 * s), low4);
        store8(out + b + 8 * s, _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), scale, min));
      }
    }
  }
}

// Threads claim the N weight rows in chunks (guided_for, multiples of
// `grain`); each takes its chunks `tile` rows at a time, widens the tile once
// into its own buffer of O (row by row: widen(codes, params, out, K, G),
// widen_row's signature) and calls use(buffer, t0, rows), which passes every
// x row over it. linear_w4 (fp32 tiles, linear_f32.cpp) and linear_w4_bf16
// (bf16, linear_bf16.cpp).
//
// The buffer has slack_rows rows more than a tile: the micro-kernels that pass
// over it prefetch weight rows ahead of those they multiply, up to
// max(kPrefetchPasses x 4 rows, kPrefetchMinBytes) past the tile's last, and
// those lines must be this thread's own. Without the slack they were the
// neighbouring heap memory, the other thread's buffer as it was being widened:
// on Zen 1 that sharing cost 2 threads 3x the CPU time of one (linear_w4 at 64
// rows: 11.0 ms wall vs 4.0 ms with the slack, one thread 7.6 ms).
constexpr int64_t kSlackRows = 16;
inline int64_t slack_rows(int64_t row_bytes) {
  return std::max<int64_t>(kSlackRows, kiln_linear::kPrefetchMinBytes / row_bytes + 2);
}

template <typename O, typename P, typename Widen, typename Use>
void over_widened_tiles(const uint8_t* codes, const P* scale_min, int64_t K, int64_t N, int64_t G, int64_t tile,
                        int64_t grain, Widen widen, Use use) {
  static_assert((kiln_linear::kPrefetchPasses + 1) * 4 <= kSlackRows);
  const int64_t groups = K / G;
  kiln_parallel::guided_for(N, grain, [&] {
    return [&, widened = std::vector<O>((tile + slack_rows(K * sizeof(O))) * K)](int64_t n_begin, int64_t n_end) mutable {
      for (int64_t t0 = n_begin; t0 < n_end; t0 += tile) {
        const int64_t rows = std::min(tile, n_end - t0);
        for (int64_t r = 0; r < rows; ++r)
          widen(codes + (t0 + r) * (K / 2), scale_min + (t0 + r) * groups * 2, widened.data() + r * K, K, G);
        use(widened.data(), t0, rows);
      }
    };
  });
}

}  // namespace kiln_int4
