// int4 group-wise weights in "lane layout" against bf16 x (the avx512_bf16
// build only): an outer product, sixteen weight rows to a zmm, widened by
// two bitwise ops per 32 weights and no table.
//
// Layout (kiln/llm/quant/int4_lanes.py writes it from the codes of
// int4_cpu.py):
//   lanes   int32 [N/16, K/8, 16]: block r (rows 16r..16r+15), chunk c
//           (weights 8c..8c+7 of each row), lane j (row 16r + j); bits
//           4p..4p+3 hold q[16r + j, 8c + 2p], bits 16+4p..16+4p+3 hold
//           q[16r + j, 8c + 2p + 1] (p = 0..3)
//   params  fp16 or fp32 [N/16, G_count, 2, 16]: (scale row, min row) of
//           block r and group g, one lane per weight row
// So `(word >> 4p) & 0x000F000F | 0x43004300` is a zmm of bf16 pairs
// (128 + q[k], 128 + q[k+1]): bf16 holds 128 + q exactly (its step at 128 is
// 1), and vdpbf16ps against the broadcast x pair (x[k], x[k+1]) adds
// (128 + q) * x for sixteen rows at once. Per group g (fp32):
//   dot_g = sum_k (128 + q_k) x_k            (vdpbf16ps along the group)
//   y    += scale_g * dot_g + (min_g - 128 scale_g) * xsum_g
// where xsum_g = sum of x over the group, i.e. y = sum_k (q_k scale_g + min_g) x_k
// with the weights unrounded (no bf16 rounding of q * scale + min). The 128
// offset cancels in fp32: a group's terms of size ~128 * sum |x| leave a
// result ~100x smaller, so ~7 of fp32's 24 bits go, against bf16's 8-bit
// output. Per output the chain is fixed (groups in order, the vdpbf16ps
// along each group in order, then the two FMAs), so a row's bits do not
// depend on M or on the tiling.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "kernels.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

namespace {

constexpr int kLanes = 16;     // weight rows per zmm
constexpr int kChunk = 8;      // weights of a row per 32-bit lane
constexpr int kGroupAlign = 32;
constexpr int64_t kPassBlocks = 6;  // blocks of one one-row pass (run())

struct LaneProblem {
  const uint16_t* x;     // bf16 bits [M, K]
  const float* xsum;     // fp32 [M, G_count]
  const uint32_t* lanes; // [N/16, K/8, 16]
  const void* params;    // fp16 bits or fp32 [N/16, G_count, 2, 16]
  bool fp32_params;
  uint16_t* y;           // bf16 bits [M, N]
  int64_t M, K, N, G;    // G: group size
  // The lanes [next_blocks, next_chunks, 16] of the call that follows on the
  // same threads, or null (see first_pass_of_next).
  const uint32_t* next = nullptr;
  int64_t next_blocks = 0, next_chunks = 0;

  // This thread's first one-row pass of the next call, as its parallel_for
  // will share the blocks out (ATen's OpenMP split: contiguous equal chunks by
  // thread number, grain kPassBlocks): (first line, lines), or (null, 0).
  // Requested during this call's last pass, it is no longer cold: in the
  // fused decode on Zen 4, qkv, o and down (three to five passes a thread)
  // ran 1.04-1.16x faster, gate_up (sixteen) level.
  std::pair<const uint32_t*, int64_t> first_pass_of_next() const {
    if (next == nullptr || next_blocks == 0) return {nullptr, 0};
    const int64_t threads = std::min<int64_t>(at::get_num_threads(), (next_blocks + kPassBlocks - 1) / kPassBlocks);
    const int64_t chunk = (next_blocks + threads - 1) / threads, begin = at::get_thread_num() * chunk;
    if (begin >= next_blocks) return {nullptr, 0};
    const int64_t blocks = std::min<int64_t>(kPassBlocks, next_blocks - begin);
    return {next + begin * next_chunks * kLanes, blocks * next_chunks};
  }

  int64_t groups() const { return K / G; }

  // (scale, min - 128 * scale) of block r, group g: one lane per weight row.
  void group_params(int64_t r, int64_t g, __m512& scale, __m512& offset_min) const {
    const int64_t at = (r * groups() + g) * 2 * kLanes;
    __m512 min;
    if (fp32_params) {
      const float* p = static_cast<const float*>(params) + at;
      scale = _mm512_loadu_ps(p);
      min = _mm512_loadu_ps(p + kLanes);
    } else {
      const uint16_t* p = static_cast<const uint16_t*>(params) + at;
      scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      min = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + kLanes)));
    }
    offset_min = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), scale, min);
  }

  // Rows m0..m0+MR, blocks r0..r0+NR; r_end: the end of the thread's blocks
  // (one x row: the next pass's blocks below it are requested meanwhile).
  template <int MR, int NR>
  void micro(int64_t m0, int64_t r0, int64_t r_end) const {
    const __m512i nibbles = _mm512_set1_epi32(0x000F000F), offset = _mm512_set1_epi32(0x43004300);
    const int64_t chunks = K / kChunk, group_chunks = G / kChunk;
    // The last pass of this thread's blocks: the next call's first pass instead, spread over the chunk steps.
    const auto [later, later_lines] = MR == 1 && r0 + 2 * NR > r_end && r_end > 0
        ? first_pass_of_next() : std::pair<const uint32_t*, int64_t>{nullptr, 0};
    const int64_t later_per_step = (later_lines + chunks - 1) / chunks;
    __m512 total[MR][NR];
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n) total[m][n] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups(); ++g) {
      __m512 dot[MR][NR];
      for (int m = 0; m < MR; ++m)
        for (int n = 0; n < NR; ++n) dot[m][n] = _mm512_setzero_ps();
      for (int64_t c = g * group_chunks; c < (g + 1) * group_chunks; ++c) {
        __m512i words[NR];
        // One x row: the NR blocks after these (the next pass's, contiguous)
        // into L2 as one linear run, NR lines per chunk step, so the whole
        // next pass arrives during this one; the hardware prefetcher follows
        // the NR interleaved block streams only to their ends. Zen 4,
        // SmolLM2's 120 projections at one row, 2 threads: 1.07-1.11x over six
        // alternated runs (1.03x at two rows; into L1 instead: 0.95x).
        if constexpr (MR == 1)
          if (r0 + 2 * NR <= r_end)
            for (int n = 0; n < NR; ++n)
              _mm_prefetch(reinterpret_cast<const char*>(lanes + ((r0 + NR) * chunks + c * NR + n) * kLanes),
                           _MM_HINT_T1);
        if (later != nullptr)
          for (int64_t l = c * later_per_step; l < std::min(later_lines, (c + 1) * later_per_step); ++l)
            _mm_prefetch(reinterpret_cast<const char*>(later + l * kLanes), _MM_HINT_T1);
        for (int n = 0; n < NR; ++n)
          words[n] = _mm512_loadu_si512(lanes + ((r0 + n) * chunks + c) * kLanes);
        for (int p = 0; p < 4; ++p) {
          __m512bh xv[MR];
          for (int m = 0; m < MR; ++m) {
            int32_t pair;
            std::memcpy(&pair, x + (m0 + m) * K + c * kChunk + 2 * p, sizeof(pair));
            xv[m] = (__m512bh)_mm512_set1_epi32(pair);
          }
          for (int n = 0; n < NR; ++n) {
            const __m512i shifted = p == 0 ? words[n] : _mm512_srli_epi32(words[n], 4 * p);
            const __m512bh w = (__m512bh)_mm512_ternarylogic_epi32(shifted, nibbles, offset, 0xEA);  // (a & b) | c
            for (int m = 0; m < MR; ++m) dot[m][n] = _mm512_dpbf16_ps(dot[m][n], xv[m], w);
          }
        }
      }
      for (int n = 0; n < NR; ++n) {
        __m512 scale, offset_min;
        group_params(r0 + n, g, scale, offset_min);
        for (int m = 0; m < MR; ++m) {
          total[m][n] = _mm512_fmadd_ps(dot[m][n], scale, total[m][n]);
          total[m][n] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[(m0 + m) * groups() + g]), offset_min, total[m][n]);
        }
      }
    }
    for (int m = 0; m < MR; ++m)
      for (int n = 0; n < NR; ++n)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (m0 + m) * N + (r0 + n) * kLanes),
                            (__m256i)_mm512_cvtneps_pbh(total[m][n]));
  }

  template <int MR, int NR>
  void rows(int64_t m0, int64_t m1, int64_t r0, int64_t r1) const {
    int64_t r = r0;
    for (; r + NR <= r1; r += NR) {
      int64_t m = m0;
      for (; m + MR <= m1; m += MR) micro<MR, NR>(m, r, r1);
      for (; m < m1; ++m) micro<1, NR>(m, r, r1);
    }
    for (; r < r1; ++r) {
      int64_t m = m0;
      for (; m + MR <= m1; m += MR) micro<MR, 1>(m, r, r1);
      for (; m < m1; ++m) micro<1, 1>(m, r, r1);
    }
  }

  // Parallel over blocks of sixteen weight rows. One x row at a time, six
  // blocks per pass (the decode case: 120 int4 projections of SmolLM2's
  // shapes, Zen 4, 2 threads: 1.89 ms against 2.25 for four blocks and 2.37
  // for two); from 4 rows, 4 rows x 3 blocks (4 x 2, 6 x 2, 3 x 4, 8 x 1 and
  // 2 x 4 were 1-15% slower at 32 and 64 rows).
  void run() const {
    const int64_t blocks = N / kLanes;
    if (M < 4)
      at::parallel_for(0, blocks, kPassBlocks, [&](int64_t r0, int64_t r1) { rows<1, kPassBlocks>(0, M, r0, r1); });
    else
      at::parallel_for(0, blocks, 3, [&](int64_t r0, int64_t r1) { rows<4, 3>(0, M, r0, r1); });
  }
};

// Per row and group, the sum of x in fp32: sixteen lanes along the group,
// then a fixed tree (the same bits for a row whatever M).
void group_sums(const uint16_t* x, float* sums, int64_t count, int64_t G) {
  for (int64_t i = 0; i < count; ++i) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t k = 0; k < G; k += kLanes) {
      const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i * G + k));
      acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16)));
    }
    sums[i] = _mm512_reduce_add_ps(acc);
  }
}

// Rows from which a step takes the projection's bf16 copy in lane layout where
// it has one (linear_bf16_lanes.cpp: no per-group scale and min to apply;
// 1.035x at 16 rows, 1.2x at 39, 1.16x at 64 on Zen 4; at 8 rows the int4
// codes, a quarter of the bytes, were 1.08x faster). One rule for the module
// path and the fused decode layer, so a row's bits are the same on both.
constexpr int64_t kLaneCopyMinRows = 16;

at::Tensor w4l_bf16(const at::Tensor& x_in, const at::Tensor& lanes_in, const at::Tensor& params_in,
                           int64_t group_size, const at::Tensor* next_lanes, const at::Tensor* copy) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(),
              "linear_w4l_bf16: bf16 CPU x [M, K] required");
  if (copy != nullptr && copy->defined() && x_in.size(0) >= kLaneCopyMinRows) {
    TORCH_CHECK(copy->dim() == 4 && copy->size(0) == lanes_in.size(0) && copy->size(1) * 2 == lanes_in.size(1) * kChunk,
                "linear_w4l_bf16: the bf16 copy [N/16, K/2, 16, 2] must match the lanes");
    return kiln::linear_bf16_lanes(x_in, *copy);
  }
  TORCH_CHECK(lanes_in.dim() == 3 && lanes_in.scalar_type() == at::kInt && lanes_in.size(2) == kLanes,
              "linear_w4l_bf16: int32 lanes [N/16, K/8, 16] required");
  const at::Tensor x = x_in.contiguous(), lanes = lanes_in.contiguous(), params = params_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = lanes.size(0) * kLanes;
  TORCH_CHECK(lanes.size(1) * kChunk == K, "linear_w4l_bf16: x has ", K, " columns, the weight ", lanes.size(1) * kChunk);
  TORCH_CHECK(group_size > 0 && group_size % kGroupAlign == 0 && K % group_size == 0,
              "linear_w4l_bf16: group_size must be a multiple of 32 dividing K");
  const int64_t G = group_size, groups = K / G;
  TORCH_CHECK((params.scalar_type() == at::kHalf || params.scalar_type() == at::kFloat) &&
                  params.numel() == (N / kLanes) * groups * 2 * kLanes,
              "linear_w4l_bf16: fp16 or fp32 params [N/16, K/G, 2, 16] required");
  at::Tensor xsum = at::empty({M, groups}, x.options().dtype(at::kFloat));
  group_sums(reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>()), xsum.mutable_data_ptr<float>(),
             M * groups, G);
  at::Tensor y = at::empty({M, N}, x.options());
  LaneProblem p{reinterpret_cast<const uint16_t*>(x.const_data_ptr<c10::BFloat16>()),
                xsum.const_data_ptr<float>(),
                reinterpret_cast<const uint32_t*>(lanes.const_data_ptr<int32_t>()),
                params.const_data_ptr(),
                params.scalar_type() == at::kFloat,
                reinterpret_cast<uint16_t*>(y.mutable_data_ptr<c10::BFloat16>()),
                M, K, N, G};
  // Only a contiguous int32 lanes tensor is read ahead (anything else: nothing is).
  if (next_lanes != nullptr && next_lanes->defined() && next_lanes->dim() == 3 &&
      next_lanes->scalar_type() == at::kInt && next_lanes->size(2) == kLanes && next_lanes->is_contiguous()) {
    p.next = reinterpret_cast<const uint32_t*>(next_lanes->const_data_ptr<int32_t>());
    p.next_blocks = next_lanes->size(0);
    p.next_chunks = next_lanes->size(1);
  }
  p.run();
  return y;
}

}  // namespace

namespace kiln {
at::Tensor linear_w4l_bf16(const at::Tensor& x, const at::Tensor& lanes, const at::Tensor& params, int64_t group_size,
                           const at::Tensor* next_lanes, const at::Tensor* copy) {
  return w4l_bf16(x, lanes, params, group_size, next_lanes, copy);
}
}  // namespace kiln

namespace {
at::Tensor linear_w4l_bf16_op(const at::Tensor& x, const at::Tensor& lanes, const at::Tensor& params,
                              int64_t group_size, const std::optional<at::Tensor>& next_lanes,
                              const std::optional<at::Tensor>& copy) {
  return w4l_bf16(x, lanes, params, group_size, next_lanes.has_value() ? &*next_lanes : nullptr,
                  copy.has_value() ? &*copy : nullptr);
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def("linear_w4l_bf16(Tensor x, Tensor lanes, Tensor params, int group_size, Tensor? next_lanes=None, "
        "Tensor? copy=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) { m.impl("linear_w4l_bf16", linear_w4l_bf16_op); }
