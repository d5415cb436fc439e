// int4 weights x int8 activations for CPU (AVX2; the avx512_bf16 build
// compiles the same code): y[M, N] = x[M, K] @ W^T, W in Int4Problem's
// layout (linear_f32.cpp: codes [N, K/2], each run of 64 weights as eight
// 32-bit words, word j holding weight 8s + j in bits 4s .. 4s+3; scale_min
// [N, K/G, 2] fp16 or fp32, w = q * scale + min).
//
// x is quantized once per call, per row in groups of 32 along K
// (quantize_x8.h, as linear_int8_vnni.cpp does): sx = max|x| / 127 (1 for
// a zero group), xq = round(x / sx), half to even. Then per group of 32
// (which lies in one weight group, G being a multiple of 32):
//
//   sum(w * x) ~= scale * sx * sum(q * xq) + min * sx * sum(xq)
//
// that is sum(w * x') exactly up to fp32 rounding, x' = sx * xq being x as
// quantized. sum(q * xq) is exact in int32 (`vpmaddubsw` then `vpmaddwd`:
// 64 multiply-adds in two instructions, instead of widening each code to
// fp32 for two FMAs), and so is sum(xq).
//
// The offset term takes the quantized x on purpose. With the exact sum of x
// instead, the error would be sum((w - min) * (x' - x)) rather than
// sum(w * (x' - x)): asymmetric groups put min near the group's lowest
// weight, so |w - min| averages well above |w|, and SmolLM2's perplexity
// measured 1.7% above fp32 activations with the exact sum against 0.7% with
// this one (int4 weights quantized by Kiln; GPTQ/AWQ-style: 2.0% vs 0.4%).
//
// Layout of one byte of a 64-weight run of codes: byte 4j + t (j = 0..7,
// t = 0..3) holds weight 16t + j (low nibble) and 16t + 8 + j (high
// nibble); t = 0, 1 lie in the run's first group of 32, t = 2, 3 in the
// second. One in-lane byte shuffle per weight row and run (shared by every x
// row) puts each group's bytes in the low half of every 128-bit lane, so the
// int32 lanes 0, 1 (and 4, 5) of the dot product belong to the first group,
// 2, 3 (and 6, 7) to the second. x is stored in the matching byte order, so
// the inner loop multiplies registers as loaded.
//
// Per run and output: those lanes are summed per group in int32 (exact),
// and each group's sum is converted to fp32, multiplied by (scale x sx) and
// added into that group's fp32 chain, then min * sx * sum(xq) is added; at
// the end the output is its two chains' sum (W4A8Problem: four weight rows'
// groups share one vector, so the fp32 work is one op per run for four
// outputs). Every micro-kernel shape computes an output by that same chain,
// and x's quantization depends only on its row, so a row's result does not
// depend on M or on the other rows (batch invariance).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int4_widen.h"
#include "kernels.h"
#include "linear_tiling.h"
#include "quantize_x8.h"

namespace kiln_w4a8 {
namespace {

constexpr int64_t kRun = 64;    // weights per 32 bytes of codes
using kiln_x8::kGroup;  // x values per scale
using kiln_x8::Group;
using kiln_x8::quantize_group;

// Code bytes within a 128-bit lane, first group's first: local bytes
// 4j + 0 and 4j + 1 (weights of the first 32) to positions 0..7.
constexpr std::array<int8_t, 16> kGroupFirst = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};

// One run of one x row as the micro-kernel reads it (128 bytes).
struct QuantizedRun {
  int8_t q[2 * 32];  // [0, 32): partners of the shuffled codes' low nibbles; [32, 64): of the high ones
  float scale[8];    // sx of each group, in the lane order of W4A8Problem's sums: (a, b, a, b, a, b, a, b)
  float sum[8];      // sx * sum(xq) of each group, likewise
};
static_assert(sizeof(QuantizedRun) == 128);

// Position p of QuantizedRun::q -> the index in the run of the x value it holds.
constexpr std::array<int8_t, 64> kSourceOf = [] {
  std::array<int8_t, 64> src{};
  for (int p = 0; p < 32; ++p) {
    const int lane = p / 16, original = kGroupFirst[p % 16];
    const int j = 4 * lane + original / 4, t = original % 4;
    src[p] = static_cast<int8_t>(16 * t + j);           // low nibble
    src[32 + p] = static_cast<int8_t>(16 * t + 8 + j);  // high nibble
  }
  return src;
}();

QuantizedRun quantize_run(const float* x) {
  int32_t q[kRun];
  const Group a = quantize_group(x, q), b = quantize_group(x + kGroup, q + kGroup);
  QuantizedRun out;
  for (int p = 0; p < 64; ++p) out.q[p] = static_cast<int8_t>(q[kSourceOf[p]]);
  const float scale[8] = {a.scale, b.scale, a.scale, b.scale, a.scale, b.scale, a.scale, b.scale};
  const float sum[8] = {a.sum, b.sum, a.sum, b.sum, a.sum, b.sum, a.sum, b.sum};
  std::memcpy(out.scale, scale, sizeof scale);
  std::memcpy(out.sum, sum, sizeof sum);
  return out;
}

void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRun* out) {
  const int64_t runs = K / kRun;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t r = 0; r < runs; ++r) out[m * runs + r] = quantize_run(x + m * K + r * kRun);
  });
}

// (scale, min) of groups ga and gb of weight rows i and j: (sa, ma, sb, mb) of i, then of j.
template <typename P>
__m256 params(const P* row_i, const P* row_j, int64_t ga, int64_t gb) {
  if constexpr (std::is_same_v<P, float>) {
    const auto pair = [&](const float* row) {
      const __m128d a = _mm_load_sd(reinterpret_cast<const double*>(row + 2 * ga));
      return _mm_castpd_ps(_mm_loadh_pd(a, reinterpret_cast<const double*>(row + 2 * gb)));
    };
    return _mm256_set_m128(pair(row_j), pair(row_i));
  } else if (gb == ga + 1) {  // groups of 32: a row's four values are adjacent
    const auto four = [&](const P* row) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 * ga)); };
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(four(row_i), four(row_j)));
  } else {
    const auto word = [](const P* at) {  // one (scale, min) fp16 pair
      int32_t v;
      std::memcpy(&v, at, 4);
      return v;
    };
    return _mm256_cvtph_ps(
        _mm_setr_epi32(word(row_i + 2 * ga), word(row_i + 2 * gb), word(row_j + 2 * ga), word(row_j + 2 * gb)));
  }
}

// The micro-kernels take weight rows four at a time (a quad), so that the
// fp32 work per run is shared: the four rows' integer dot products, each
// eight int32 lanes (lanes 0, 1, 4, 5 of group a, the rest of group b), are
// summed per group into one vector (exact: integer adds), lanes ordered
// (r0 a, r0 b, r2 a, r2 b | r1 a, r1 b, r3 a, r3 b), then converted, scaled
// and accumulated lane-wise. Per output that is two fp32 chains, one over its
// runs' first groups and one over their second:
//
//   acc = fma(float(dot), scale * sx, acc); acc = fma(min, sx * sum(xq), acc)
//
// and y = chain a + chain b at the end. Lane-wise operations round each lane
// alike wherever it sits, so every shape (one to four rows of the quad used,
// any number of x rows) gives an output the same bits. A quad missing rows
// (N % 4, narrow tails) repeats its last row and drops those outputs.
template <typename P>
struct W4A8Problem {
  static constexpr int kQuad = 4;
  static constexpr int kWideRows = 4, kWideCols = kQuad, kSingleRowCols = kQuad;
  static constexpr int narrow_cols(int) { return kQuad; }
  const QuantizedRun* x;        // [M, K / 64]
  const uint8_t* codes;         // [N, K / 2]
  const P* scale_min;           // [N, K / G, 2]
  const int32_t* group_of_half; // [K / 32]: the weight group of weights 32h .. 32h + 31 (no division per run)
  float* y;
  int64_t K, N, G;

  int64_t row_bytes() const { return K / 2; }
  int64_t x_row_bytes() const { return K / kRun * static_cast<int64_t>(sizeof(QuantizedRun)); }

  // The dot products of one run of a weight row (codes shuffled by kGroupFirst, lo / hi nibbles)
  // with one run of x, as int16 sums of four products: lanes 0-3 of each 128-bit half of group a,
  // 4-7 of group b. vpmaddubsw saturates each sum of two products to int16; here
  // |q * xq| <= 15 * 127, so a pair is at most 3810 and the low + high sum 7620: exact.
  static __m256i dot(__m256i lo, __m256i hi, const QuantizedRun& xr) {
    const __m256i l = _mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q)));
    const __m256i h = _mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q + 32)));
    return _mm256_add_epi16(l, h);
  }

  // Four rows' dot products -> per group int32 sums, lanes (r0 a, r0 b, r2 a, r2 b | r1 a, r1 b, r3 a,
  // r3 b). Two rounds of pairwise int16 adds stay exact (at most 4 x 7620 = 30480 < 2^15), and
  // leave each group's sum split between the two 128-bit halves, added in int32. (No vpmaddwd:
  // on Zen 1 it shares the one integer multiply pipe with vpmaddubsw, the kernel's bottleneck.)
  static __m256i per_group(const __m256i d[kQuad]) {
    const __m256i t = _mm256_hadd_epi16(_mm256_hadd_epi16(d[0], d[2]), _mm256_hadd_epi16(d[1], d[3]));
    return _mm256_add_epi32(_mm256_cvtepi16_epi32(_mm256_castsi256_si128(t)),
                            _mm256_cvtepi16_epi32(_mm256_extracti128_si256(t, 1)));
  }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    static_assert(NR <= kQuad);
    const int64_t runs = K / kRun, stride = K / 2, groups = K / G;
    const QuantizedRun* __restrict xr = x + m0 * runs;
    const uint8_t* row[kQuad];
    const P* prm[kQuad];
    for (int s = 0; s < kQuad; ++s) {
      const int64_t n = n0 + std::min(s, NR - 1);  // a missing row repeats the last one
      row[s] = codes + n * stride;
      prm[s] = scale_min + n * groups * 2;
    }
    const __m256i order =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kGroupFirst.data())));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    __m256 acc[MR];
    for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; ++r) {
      const int64_t off = r * (kRun / 2);
      if (r % 2 == 0)  // the next rows, a line at a time (see linear_f32.cpp's DenseProblem)
        kiln_linear::prefetch_ahead<NR>(row[0], stride, off);
      const int64_t ga = group_of_half[2 * r], gb = group_of_half[2 * r + 1];
      const __m256 p01 = params(prm[0], prm[1], ga, gb), p23 = params(prm[2], prm[3], ga, gb);
      const __m256 scale = _mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(2, 0, 2, 0));
      const __m256 min = _mm256_shuffle_ps(p01, p23, _MM_SHUFFLE(3, 1, 3, 1));
      __m256i lo[kQuad], hi[kQuad];
      for (int s = 0; s < kQuad; ++s) {
        const __m256i packed =
            _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row[s] + off)), order);
        lo[s] = _mm256_and_si256(packed, low4);
        hi[s] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4);
      }
      for (int m = 0; m < MR; ++m) {
        const QuantizedRun& xm = xr[m * runs + r];
        __m256i d[kQuad];
        for (int s = 0; s < kQuad; ++s) d[s] = dot(lo[s], hi[s], xm);
        const __m256 sums = _mm256_cvtepi32_ps(per_group(d));
        acc[m] = _mm256_fmadd_ps(sums, _mm256_mul_ps(scale, _mm256_loadu_ps(xm.scale)), acc[m]);
        acc[m] = _mm256_fmadd_ps(min, _mm256_loadu_ps(xm.sum), acc[m]);
      }
    }
    constexpr int kLane[kQuad] = {0, 4, 2, 6};  // quad row s -> its group a lane (group b: the next)
    for (int m = 0; m < MR; ++m) {
      float lanes[8];
      _mm256_storeu_ps(lanes, acc[m]);
      for (int s = 0; s < NR; ++s) y[(m0 + m) * N + n0 + s] = lanes[kLane[s]] + lanes[kLane[s] + 1];
    }
  }
};

template <typename P>
void run(const at::Tensor& x, const at::Tensor& codes, const P* scale_min, at::Tensor& y, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor xq = at::empty({M, K / kRun * static_cast<int64_t>(sizeof(QuantizedRun))}, x.options().dtype(at::kByte));
  auto* runs = reinterpret_cast<QuantizedRun*>(xq.mutable_data_ptr<uint8_t>());
  quantize_rows(x.const_data_ptr<float>(), M, K, runs);
  std::vector<int32_t> group_of_half(K / kGroup);
  for (int64_t h = 0; h < K / kGroup; ++h) group_of_half[h] = static_cast<int32_t>(h * kGroup / group_size);
  const W4A8Problem<P> p{runs, codes.const_data_ptr<uint8_t>(), scale_min, group_of_half.data(),
                         y.mutable_data_ptr<float>(), K, codes.size(0), group_size};
  kiln_linear::Kernels<W4A8Problem<P>>::run(p, M);
}

}  // namespace
}  // namespace kiln_w4a8

namespace kiln {
// x fp32 [M, K] @ int4-group weights (Int4Problem's layout)^T, x quantized to int8 in groups of 32 (see above).
at::Tensor linear_w4a8(const at::Tensor& x_in, const at::Tensor& codes, const at::Tensor& scale_min,
                       int64_t group_size) {
  const kiln_int4::Weight w = kiln_int4::checked_weight(codes, scale_min, group_size, "linear_w4a8");
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == w.K, "linear_w4a8: shape mismatch");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(), "linear_w4a8: fp32 CPU x required");
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty({x.size(0), w.N}, x.options());
  w.with_params([&](const auto* params) { kiln_w4a8::run(x, w.codes, params, y, w.G); });
  return y;
}
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln, m) { m.def("linear_w4a8(Tensor x, Tensor codes, Tensor scale_min, int group_size) -> Tensor"); }
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_w4a8", kiln::linear_w4a8); }
