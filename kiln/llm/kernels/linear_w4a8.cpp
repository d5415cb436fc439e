// int4 weights x int8 activations for CPU (AVX2; the avx512_bf16 build
// compiles the same code): y[M, N] = x[M, K] @ W^T, W in Int4Problem's
// layout (linear_f32.cpp: codes [N, K/2], each run of 64 weights as eight
// 32-bit words, word j holding weight 8s + j in bits 4s .. 4s+3; scale_min
// [N, K/G, 2] fp16 or fp32, w = q * scale + min).
//
// x is quantized once per call, per row in groups of 32 along K as
// linear_int8_vnni.cpp does: sx = max|x| / 127 (1 for a zero group),
// xq = round(x / sx), half to even. Then per group of 32 (which lies in one
// weight group, G being a multiple of 32):
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
// Per run and output: those eight int32 lanes are converted to fp32,
// multiplied by (scale x sx) of their lanes' group and added into an fp32
// accumulator, then min * sx * sum(xq) of each group is added (one lane
// per group); at the end the eight lanes are summed in a fixed order. Every
// micro-kernel shape computes an output by that same chain, and x's
// quantization depends only on its row, so a row's result does not depend
// on M or on the other rows (batch invariance).
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
#include "simd.h"

namespace kiln_w4a8 {
namespace {

constexpr int64_t kRun = 64;    // weights per 32 bytes of codes
constexpr int64_t kGroup = 32;  // x values per scale

// Code bytes within a 128-bit lane, first group's first: local bytes
// 4j + 0 and 4j + 1 (weights of the first 32) to positions 0..7.
constexpr std::array<int8_t, 16> kGroupFirst = {0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15};

// One run of one x row as the micro-kernel reads it (128 bytes).
struct QuantizedRun {
  int8_t q[2 * 32];  // [0, 32): partners of the shuffled codes' low nibbles; [32, 64): of the high ones
  float scale[8];    // sx of the group of each int32 lane: (a, a, b, b, a, a, b, b)
  float sum[8];      // sx * sum(xq) per group, one lane each: (a, 0, b, 0, 0, 0, 0, 0)
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

struct Group {
  float scale, sum;  // sx, and sx * sum(xq): the sum of x as quantized
};

// One group of 32 x values -> round(x / sx) into q[0..32) (natural order), sx and sx * sum(xq).
Group quantize_group(const float* x, int32_t* q) {
  __m256 v[4], amax = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  float lanes[8];
  _mm256_storeu_ps(lanes, amax);
  float m = 0.0f;
  for (float a : lanes) m = std::max(m, a);
  // |x * inv| <= 127 (up to rounding of inv, never to 127.5): the codes fit int8.
  const __m256 inv = _mm256_set1_ps(m > 0.0f ? 127.0f / m : 0.0f);
  for (int i = 0; i < 4; ++i)  // cvtps rounds to nearest even (MXCSR default), as torch.round
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
  int32_t qsum = 0;
  for (int i = 0; i < 32; ++i) qsum += q[i];
  const float sx = m > 0.0f ? m / 127.0f : 1.0f;
  return {sx, sx * static_cast<float>(qsum)};
}

QuantizedRun quantize_run(const float* x) {
  int32_t q[kRun];
  const Group a = quantize_group(x, q), b = quantize_group(x + kGroup, q + kGroup);
  QuantizedRun out;
  for (int p = 0; p < 64; ++p) out.q[p] = static_cast<int8_t>(q[kSourceOf[p]]);
  const float scale[8] = {a.scale, a.scale, b.scale, b.scale, a.scale, a.scale, b.scale, b.scale};
  const float sum[8] = {a.sum, 0.0f, b.sum, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
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

// One run of one weight row, ready for every x row.
struct WeightRun {
  __m256i lo, hi;     // codes 0..15 per byte, shuffled (kGroupFirst)
  __m256 scale, min;  // of each int32 lane's group: (a, a, b, b, a, a, b, b)
};

// (scale, min) of groups ga and gb of one row as (scale a, min a, scale b, min b).
template <typename P>
__m128 params(const P* row, int64_t ga, int64_t gb) {
  if constexpr (std::is_same_v<P, float>) {
    const __m128d a = _mm_load_sd(reinterpret_cast<const double*>(row + 2 * ga));
    return _mm_castpd_ps(_mm_loadh_pd(a, reinterpret_cast<const double*>(row + 2 * gb)));
  } else {
    int32_t a, b;
    std::memcpy(&a, row + 2 * ga, 4);
    std::memcpy(&b, row + 2 * gb, 4);
    return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128(a), b, 1));
  }
}

template <typename P>
struct W4A8Problem {
  static constexpr int kWideRows = 4, kWideCols = 3, kSingleRowCols = 4;
  const QuantizedRun* x;        // [M, K / 64]
  const uint8_t* codes;         // [N, K / 2]
  const P* scale_min;           // [N, K / G, 2]
  const int32_t* group_of_half; // [K / 32]: the weight group of weights 32h .. 32h + 31 (no division per run)
  float* y;
  int64_t K, N, G;

  int64_t row_bytes() const { return K / 2; }
  int64_t x_row_bytes() const { return K / kRun * static_cast<int64_t>(sizeof(QuantizedRun)); }

  // One run of a weight row: its 32 bytes of codes and (scale, min) of its two halves' groups.
  static WeightRun weights(const uint8_t* run, const P* params_row, int64_t ga, int64_t gb) {
    const __m256i order =
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(kGroupFirst.data())));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i packed = _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(run)), order);
    const __m128 f = params(params_row, ga, gb);
    const __m256 f2 = _mm256_set_m128(f, f);
    return {_mm256_and_si256(packed, low4), _mm256_and_si256(_mm256_srli_epi16(packed, 4), low4),
            _mm256_permute_ps(f2, 0b10100000), _mm256_permute_ps(f2, 0b11110101)};
  }

  // acc + this run's contribution to one output.
  static __m256 step(const WeightRun& w, const QuantizedRun& xr, __m256 acc) {
    // vpmaddubsw saturates each sum of two products to int16; here
    // |q * xq| <= 15 * 127, so a pair is at most 3810 and the low + high sum
    // 7620: it never saturates, and vpmaddwd's int32 sums are exact.
    const __m256i lo = _mm256_maddubs_epi16(w.lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q)));
    const __m256i hi = _mm256_maddubs_epi16(w.hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr.q + 32)));
    const __m256i dot = _mm256_madd_epi16(_mm256_add_epi16(lo, hi), _mm256_set1_epi16(1));
    const __m256 scale = _mm256_mul_ps(w.scale, _mm256_loadu_ps(xr.scale));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc);
    return _mm256_fmadd_ps(w.min, _mm256_loadu_ps(xr.sum), acc);
  }

  template <int MR, int NR>
  void micro(int64_t m0, int64_t n0) const {
    const int64_t runs = K / kRun, stride = K / 2, groups = K / G;
    const QuantizedRun* __restrict xr = x + m0 * runs;
    const uint8_t* __restrict wr = codes + n0 * stride;
    const P* __restrict pr = scale_min + n0 * groups * 2;
    __m256 acc[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) acc[m][n] = _mm256_setzero_ps();
    for (int64_t r = 0; r < runs; ++r) {
      const uint8_t* run = wr + r * (kRun / 2);
      if (r % 2 == 0)  // one cache line of each of the next rows (see linear_f32.cpp's DenseProblem)
        for (int n = 0; n < NR; ++n)
          _mm_prefetch(reinterpret_cast<const char*>(run + (kiln_linear::kPrefetchPasses * NR + n) * stride),
                       _MM_HINT_T0);
      const int64_t ga = group_of_half[2 * r], gb = group_of_half[2 * r + 1];
      for (int n = 0; n < NR; ++n) {
        const WeightRun w = weights(run + n * stride, pr + n * groups * 2, ga, gb);
        for (int m = 0; m < MR; ++m) acc[m][n] = step(w, xr[m * runs + r], acc[m][n]);
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) y[(m0 + m) * N + n0 + n] = kiln_simd::hsum(acc[m][n]);
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
