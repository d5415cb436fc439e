// One Llama decoder layer for a decode-only step (fp32 or bf16 CPU), in one call.
//
// At batch 1 the projections take ~75% of a step; most of the rest was the
// Python and dispatcher cost of ~15 torch ops per layer (module calls,
// views, checks). This runs the same kernels in the same order as
// kiln/llm/models/llama.py's LlamaLayer does for such a step, so its output
// is bit-identical to the module path:
//
//   h = rms_norm(x); qkv = h @ Wqkv; rotary(q, k); pool[slots] = k, v (in the pool's dtype)
//   a = paged_decode_attention(q) per decode group; o = a @ Wo
//   h, x = add_rms_norm(o, x); x = x + down(silu(gate) * up)
//
// A projection is given as the tensors its Linear module holds: [w] fp32 or
// bf16 (the model's dtype: x, the norms and the outputs are in it too),
// [w int8, scales fp32] or [codes uint8, scale_min fp16 or fp32] (int4, with
// its group size; a bf16 model's quantized projections widen x to fp32 where
// their modules do). The families with Llama's layer plus small variations pass
// them too: a q|k|v bias added after the projection (Qwen2), RMSNorm over
// each head of q and k before rope (Qwen3), rope on the first `rotary_dim`
// dims of a head only (Phi-4-mini; 0: all), a sliding window (Mistral, Phi-3).
// (kiln/llm/models/fused_decode.py passes bias, q/k norms and partial rope
// for fp32 models only.) Gemma's layer (kiln/llm/models/gemma.py) is this one
// with a softmax scale other than head_dim^-0.5 and soft-capped scores
// (`scale`, `softcap`: 0 means none), "sandwich" norms (`attn_out_norm` on o
// before its residual add, `post_norm` then being the MLP's input norm, and
// `mlp_out_norm` on the MLP's output before its add) and GeGLU (`gelu`):
//
//   o = rms_norm(o, attn_out_norm); h, x = add_rms_norm(o, x)
//   x = x + rms_norm(down(gelu_tanh(gate) * up), mlp_out_norm)
//
// `decode_attention` is the same layer up to and including add_rms_norm, and
// returns (h, x) there: a mixture-of-experts layer (Mixtral, Qwen3-MoE)
// routes h in Python and runs its experts through `moe_experts` (x + moe(h),
// as LlamaLayer.forward). decode_layer is decode_attention followed by the
// dense MLP, so the two cannot drift apart.
//
// `moe_experts` is SparseMoeBlock.forward (kiln/llm/models/moe.py) after its
// routing, with the same ops in the same order, so bit-identical: each expert
// with work, in ascending order, runs once over its rows (the (token, choice)
// pairs routed to it, in pair order: the stable sort's) and its weighted
// output is index_add-ed into zeros; a one-token step sums its experts'
// weighted outputs in ascending expert order instead. In Python the ~8 torch
// ops per expert cost ~1 ms per layer at 16 tokens (a quarter of the block).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"

namespace {

// Opt-in op timing of decode_attention / decode_layer (decode_profile_start /
// decode_profile_stop; bench/decode_ops.py): wall time and calls per op of
// the calling thread, for finding where a decode step goes without editing
// this file. Off: one relaxed load per op. The counters are process-wide;
// two engines stepping at once in one process would add into the same ones.
namespace decode_profile {
// kLayer: a whole layer of DecodeStack.run (the ops above plus what lies between them).
enum Op { kNorm, kQkv, kQkNorm, kRope, kKvWrite, kAttention, kO, kAddNorm, kGateUp, kActivation, kDown,
          kSandwichNorm, kResidual, kLayer, kOps };
constexpr const char* kNames[kOps] = {
    "input_norm", "qkv",  "qk_norm", "rope",           "kv_write", "attention", "o",
    "post_norm",  "gate_up", "activation", "down", "sandwich_norms", "residual", "layer"};
std::atomic<bool> enabled{false};
std::atomic<int64_t> nanos[kOps], calls[kOps];

// Adds the time from construction to destruction to op `op` (when enabled at construction).
class Timed {
 public:
  explicit Timed(Op op) : op_(op), on_(enabled.load(std::memory_order_relaxed)) {
    if (on_) start_ = std::chrono::steady_clock::now();
  }
  ~Timed() {
    if (!on_) return;
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start_);
    nanos[op_].fetch_add(ns.count(), std::memory_order_relaxed);
    calls[op_].fetch_add(1, std::memory_order_relaxed);
  }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  Op op_;
  bool on_;
  std::chrono::steady_clock::time_point start_;
};

// f() timed as op `op`.
template <typename F>
decltype(auto) timed(Op op, F&& f) {
  Timed t(op);
  return f();
}

// Zeroes the counters and starts timing.
void start() {
  for (int i = 0; i < kOps; ++i) nanos[i] = 0, calls[i] = 0;
  enabled = true;
}

// (op names, [ops, 2] int64: nanoseconds, calls); stops timing.
std::tuple<std::vector<std::string>, at::Tensor> stop() {
  enabled = false;
  at::Tensor out = at::empty({kOps, 2}, at::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (int i = 0; i < kOps; ++i) a[i][0] = nanos[i].load(), a[i][1] = calls[i].load();
  return {std::vector<std::string>(kNames, kNames + kOps), out};
}
}  // namespace decode_profile

using decode_profile::timed;
namespace dp = decode_profile;

// next: the first tensor of the projection that runs after this one (its
// first pass is requested meanwhile where both are int4 lanes), or null.
at::Tensor project(const at::Tensor& x, at::TensorList w, int64_t group_size, const at::Tensor* next = nullptr) {
  if (w.size() == 1) return w[0].scalar_type() == at::kBFloat16 ? kiln::linear_bf16(x, w[0]) : kiln::linear_f32(x, w[0]);
  const bool lanes = w[0].scalar_type() == at::kInt;
  TORCH_CHECK(w.size() == 2 || (lanes && w.size() == 3),
              "decode_layer: a projection is [w], [w, scales], [codes, scale_min] or [lanes, params(, bf16 copy)]");
  if (lanes) {  // int4 in lane layout: a bf16 model's, as Int4LaneLinear (with its bf16 copy in lanes, if kept)
#if KILN_AVX512_BF16
    return kiln::linear_w4l_bf16(x, w[0], w[1], group_size, next, w.size() == 3 ? &w[2] : nullptr);
#else
    TORCH_CHECK(false, "decode_layer: int4 lanes need the avx512_bf16 build");
#endif
  }
  if (w[0].scalar_type() == at::kChar) {  // a bf16 model's rows widened, its result rounded once, as Int8Linear
    if (x.scalar_type() != at::kFloat) return kiln::linear_w8(x.to(at::kFloat), w[0], w[1]).to(x.scalar_type());
    return kiln::linear_w8(x, w[0], w[1]);
  }
  // group_size < 0: an fp32 model under --int4-activations int8 (groups of -group_size), as Int4CpuLinear.
  if (group_size < 0) return kiln::linear_w4a8(x, w[0], w[1], -group_size);
  // A bf16 model's int4 projection, as Int4CpuLinear computes it: with bf16 dot
  // products on the weights rounded to bf16 where the build has them, else the
  // fp32 kernel on x widened, rounded once.
#if KILN_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) return kiln::linear_w4_bf16(x, w[0], w[1], group_size);
#endif
  if (x.scalar_type() != at::kFloat) return kiln::linear_w4(x.to(at::kFloat), w[0], w[1], group_size).to(x.scalar_type());
  return kiln::linear_w4(x, w[0], w[1], group_size);
}

// projections: qkv, o (each a list, see above); norms: input, post-attention.
// Returns (h, x): the MLP's input and the residual stream. next_lanes: the
// first tensor of the projection that runs after o (project's `next`).
std::tuple<at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& x, at::TensorList qkv_w, at::TensorList o_w, int64_t group_size, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& kv_cache,
    const at::Tensor& slot_mapping, at::TensorList block_tables, at::TensorList context_lens, int64_t block_size,
    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const std::optional<at::Tensor>& qkv_bias,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, int64_t rotary_dim,
    int64_t window, double scale, double softcap, const std::optional<at::Tensor>& attn_out_norm,
    const std::optional<at::Tensor>& next_lanes) {
  TORCH_CHECK(block_tables.size() == context_lens.size(), "decode_layer: one block table per decode group");
  TORCH_CHECK(scale >= 0 && softcap >= 0, "decode_layer: scale and softcap must be >= 0 (0: the default, none)");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "decode_layer: q_norm and k_norm come together");
  const int64_t T = x.size(0), q_size = num_heads * head_dim, kv_size = num_kv_heads * head_dim;
  const at::Tensor h = timed(dp::kNorm, [&] { return kiln::rms_norm(x, input_norm, eps); });
  at::Tensor qkv = timed(dp::kQkv, [&] {
    at::Tensor y = project(h, qkv_w, group_size, &o_w[0]);
    return qkv_bias.has_value() ? y + *qkv_bias : y;
  });
  at::Tensor q = qkv.narrow(1, 0, q_size).view({T, num_heads, head_dim});
  at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, num_kv_heads, head_dim});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, num_kv_heads, head_dim});
  if (q_norm.has_value()) {
    dp::Timed t(dp::kQkNorm);
    q = kiln::rms_norm(q.reshape({-1, head_dim}), *q_norm, eps).view({T, num_heads, head_dim});
    k = kiln::rms_norm(k.reshape({-1, head_dim}), *k_norm, eps).view({T, num_kv_heads, head_dim});
  }
  {
    dp::Timed t(dp::kRope);
    if (rotary_dim > 0 && rotary_dim < head_dim) {
      kiln::rotary_(q.narrow(2, 0, rotary_dim), k.narrow(2, 0, rotary_dim), cos, sin);
    } else {
      kiln::rotary_(q, k, cos, sin);
    }
  }
  const at::Tensor k_pool = kv_cache.select(0, 0), v_pool = kv_cache.select(0, 1);
  {
    dp::Timed t(dp::kKvWrite);
    kiln::write_kv(k_pool, v_pool, k, v, slot_mapping);
  }
  if (scale == 0) scale = std::pow(static_cast<double>(head_dim), -0.5);  // as Python's head_dim**-0.5
  const at::Tensor attn = timed(dp::kAttention, [&] {
    if (block_tables.size() == 1)
      return kiln::paged_decode_attention(q, k_pool, v_pool, block_tables[0], context_lens[0], block_size, scale,
                                          window, softcap);
    at::Tensor out = at::empty_like(q);
    int64_t row = 0;
    for (size_t g = 0; g < block_tables.size(); ++g) {
      const int64_t rows = block_tables[g].size(0);
      out.narrow(0, row, rows).copy_(kiln::paged_decode_attention(
          q.narrow(0, row, rows), k_pool, v_pool, block_tables[g], context_lens[g], block_size, scale, window,
          softcap));
      row += rows;
    }
    TORCH_CHECK(row == T, "decode_layer: decode groups must cover every row");
    return out;
  });
  at::Tensor o = timed(dp::kO, [&] {
    return project(attn.view({T, q_size}), o_w, group_size, next_lanes ? &*next_lanes : nullptr);
  });
  if (attn_out_norm.has_value()) o = timed(dp::kSandwichNorm, [&] { return kiln::rms_norm(o, *attn_out_norm, eps); });
  return timed(dp::kAddNorm, [&] { return kiln::add_rms_norm(o, x, post_norm, eps); });
}

// decode_attention's arguments with the MLP's projections (gate_up, down) after o;
// next_lanes: the first tensor of the projection that runs after down (the
// next layer's qkv in DecodeStack.run).
at::Tensor decode_layer(const at::Tensor& x, at::TensorList qkv_w, at::TensorList o_w, at::TensorList gate_up_w,
                        at::TensorList down_w, int64_t group_size, const at::Tensor& input_norm,
                        const at::Tensor& post_norm, double eps, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& kv_cache, const at::Tensor& slot_mapping, at::TensorList block_tables,
                        at::TensorList context_lens, int64_t block_size, int64_t num_heads, int64_t num_kv_heads,
                        int64_t head_dim, const std::optional<at::Tensor>& qkv_bias,
                        const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm,
                        int64_t rotary_dim, int64_t window, double scale, double softcap,
                        const std::optional<at::Tensor>& attn_out_norm, const std::optional<at::Tensor>& mlp_out_norm,
                        bool gelu, const std::optional<at::Tensor>& next_lanes) {
  auto [h, residual] = decode_attention(x, qkv_w, o_w, group_size, input_norm, post_norm, eps, cos, sin, kv_cache,
                                        slot_mapping, block_tables, context_lens, block_size, num_heads,
                                        num_kv_heads, head_dim, qkv_bias, q_norm, k_norm, rotary_dim, window, scale,
                                        softcap, attn_out_norm, gate_up_w[0]);
  const at::Tensor gate_up = timed(dp::kGateUp, [&] { return project(h, gate_up_w, group_size, &down_w[0]); });
  const at::Tensor act = timed(dp::kActivation, [&] {
    return gelu ? kiln::gelu_tanh_mul(gate_up) : kiln::silu_mul(gate_up);
  });
  at::Tensor out = timed(dp::kDown, [&] {
    return project(act, down_w, group_size, next_lanes ? &*next_lanes : nullptr);
  });
  if (mlp_out_norm.has_value()) out = timed(dp::kSandwichNorm, [&] { return kiln::rms_norm(out, *mlp_out_norm, eps); });
  return timed(dp::kResidual, [&] { return kiln::add_into(out, residual); });
}

// Every layer of a dense model (no MoE block) for one decode-only step: the
// layers' tensors and options are held once (add_layer, at load), so a step is
// one call (run) instead of one decode_layer call per layer, whose ~29
// arguments cost the Python caller and the dispatcher more than a 1-row
// layer's small ops. run calls decode_layer layer by layer, so its output is
// bit-identical to the per-layer calls.
struct DecodeStack : torch::CustomClassHolder {
  struct Layer {
    std::vector<at::Tensor> qkv, o, gate_up, down;
    int64_t group_size;
    at::Tensor input_norm, post_norm;
    std::optional<at::Tensor> qkv_bias, q_norm, k_norm, attn_out_norm, mlp_out_norm;
    int64_t window;
    double scale, softcap;
    bool gelu, local_rope;
  };
  // A step's ends (set_ends, once at load), for step(): the embedding table
  // and its scale (0: none), the final norm, the rope tables by position
  // ([positions, rotary_dim / 2]; local: Gemma 3's window layers').
  struct Ends {
    at::Tensor embed;
    double embed_scale;
    at::Tensor final_norm;
    double final_eps;
    at::Tensor cos, sin, local_cos, local_sin;
  };
  double eps;
  int64_t num_heads, num_kv_heads, head_dim, rotary_dim;
  std::vector<Layer> layers;
  std::optional<Ends> ends;

  DecodeStack(double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim)
      : eps(eps), num_heads(num_heads), num_kv_heads(num_kv_heads), head_dim(head_dim), rotary_dim(rotary_dim) {}

  void add_layer(std::vector<at::Tensor> qkv, std::vector<at::Tensor> o, std::vector<at::Tensor> gate_up,
                 std::vector<at::Tensor> down, int64_t group_size, at::Tensor input_norm, at::Tensor post_norm,
                 std::optional<at::Tensor> qkv_bias, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, int64_t window, double scale, double softcap,
                 std::optional<at::Tensor> attn_out_norm, std::optional<at::Tensor> mlp_out_norm, bool gelu,
                 bool local_rope) {
    layers.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down), group_size,
                           std::move(input_norm), std::move(post_norm), std::move(qkv_bias), std::move(q_norm),
                           std::move(k_norm), std::move(attn_out_norm), std::move(mlp_out_norm), window, scale,
                           softcap, gelu, local_rope});
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  void set_ends(at::Tensor embed, double embed_scale, at::Tensor final_norm, double final_eps, at::Tensor cos,
                at::Tensor sin, at::Tensor local_cos, at::Tensor local_sin) {
    ends = Ends{std::move(embed), embed_scale, std::move(final_norm), final_eps, std::move(cos), std::move(sin),
                std::move(local_cos), std::move(local_sin)};
  }

  // A decode-only step from token ids to the final norm's output, as
  // LlamaModel.forward computes it around run (the same ops, so the same
  // bits): embedding rows (times the scale rounded to their dtype), the rope
  // tables' rows at `positions`, the layers, the final norm. One call instead
  // of four from Python, whose cold cost in a one-row step was ~130 us (a
  // step streams the weights through the caches, and the interpreter's working
  // set comes back from DRAM after it).
  at::Tensor step(const at::Tensor& ids, const at::Tensor& positions, const std::vector<at::Tensor>& kv_caches,
                  const at::Tensor& slot_mapping, const std::vector<at::Tensor>& block_tables,
                  const std::vector<at::Tensor>& context_lens, int64_t block_size) const {
    TORCH_CHECK(ends.has_value(), "DecodeStack.step: set_ends first");
    const Ends& e = *ends;
    at::Tensor x = at::embedding(e.embed, ids);
    if (e.embed_scale != 0) x = x * at::scalar_tensor(e.embed_scale, x.options());
    const auto at_positions = [&](const at::Tensor& table) { return table.index_select(0, positions).unsqueeze(1); };
    const at::Tensor cos = at_positions(e.cos), sin = at_positions(e.sin);
    const bool local = e.local_cos.defined() && e.local_cos.numel() > 0;
    x = run(x, cos, sin, local ? at_positions(e.local_cos) : cos, local ? at_positions(e.local_sin) : sin, kv_caches,
            slot_mapping, block_tables, context_lens, block_size);
    return kiln::rms_norm(x, e.final_norm, e.final_eps);
  }

  // kv_caches: one per layer; (local_cos, local_sin): the tables of layers with local_rope.
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& local_cos,
                 const at::Tensor& local_sin, const std::vector<at::Tensor>& kv_caches,
                 const at::Tensor& slot_mapping, const std::vector<at::Tensor>& block_tables,
                 const std::vector<at::Tensor>& context_lens, int64_t block_size) const {
    TORCH_CHECK(kv_caches.size() == layers.size(), "DecodeStack.run: one KV cache per layer (", layers.size(),
                "), got ", kv_caches.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const Layer& f = layers[i];
      dp::Timed layer_time(dp::kLayer);
      const std::optional<at::Tensor> next_qkv =
          i + 1 < layers.size() ? std::optional<at::Tensor>(layers[i + 1].qkv[0]) : std::nullopt;
      x = decode_layer(x, f.qkv, f.o, f.gate_up, f.down, f.group_size, f.input_norm, f.post_norm, eps,
                       f.local_rope ? local_cos : cos, f.local_rope ? local_sin : sin, kv_caches[i], slot_mapping,
                       block_tables, context_lens, block_size, num_heads, num_kv_heads, head_dim, f.qkv_bias,
                       f.q_norm, f.k_norm, rotary_dim, f.window, f.scale, f.softcap, f.attn_out_norm,
                       f.mlp_out_norm, f.gelu, next_qkv);
    }
    return x;
  }
};

at::Tensor expert_mlp(const at::Tensor& x, at::TensorList gate_up_w, at::TensorList down_w, int64_t group_size) {
  return project(kiln::silu_mul(project(x, gate_up_w, group_size)), down_w, group_size);
}

// The grouped loop's gather and scatter as plain loops (as index_select and
// `out.index_add_(0, rows, y * w)` compute them: a product rounded to the
// dtype, then a sum rounded to it; -ffp-contract=off keeps them two
// roundings): the ~6 ATen ops per expert they replace cost more than the
// arithmetic at decode sizes. Pair p is token p / k.
template <typename T>
void gather_rows(const at::Tensor& x, const std::vector<int64_t>& pairs, int64_t k, const at::Tensor& rows) {
  const int64_t H = x.size(1);
  const T* src = x.const_data_ptr<T>();
  T* dst = rows.mutable_data_ptr<T>();
  for (size_t i = 0; i < pairs.size(); ++i) std::copy_n(src + pairs[i] / k * H, H, dst + i * H);
}

template <typename T>
void add_weighted_rows(const at::Tensor& y_in, const at::Tensor& weights, const std::vector<int64_t>& pairs,
                       int64_t k, at::Tensor& out) {
  const at::Tensor y = y_in.contiguous();
  const int64_t H = out.size(1);
  const T* yp = y.const_data_ptr<T>();
  const T* wp = weights.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  for (size_t i = 0; i < pairs.size(); ++i) {
    T* o = op + pairs[i] / k * H;
    const T* yi = yp + i * H;
    const T w = wp[pairs[i]];
    for (int64_t c = 0; c < H; ++c) o[c] = o[c] + static_cast<T>(yi[c] * w);
  }
}

// h [T, H]; ids [T, k] int64 and weights [T, k] (h's dtype) from routing;
// gate_up_w / down_w: every expert's projection tensors, expert e's at
// [e * per, (e + 1) * per) with per = len / num_experts.
at::Tensor moe_experts(const at::Tensor& h, const at::Tensor& ids_in, const at::Tensor& weights,
                       at::TensorList gate_up_w, at::TensorList down_w, int64_t num_experts, int64_t group_size) {
  const int64_t T = h.size(0), k = ids_in.size(1);
  TORCH_CHECK(ids_in.dim() == 2 && ids_in.size(0) == T && weights.sizes() == ids_in.sizes(),
              "moe_experts: ids and weights [T, k] required");
  TORCH_CHECK(num_experts > 0 && static_cast<int64_t>(gate_up_w.size()) % num_experts == 0 &&
                  gate_up_w.size() == down_w.size(),
              "moe_experts: every expert needs its gate_up and down tensors");
  const size_t per = gate_up_w.size() / num_experts;
  const at::Tensor ids = ids_in.to(at::kLong).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  auto expert = [&](int64_t e, const at::Tensor& x) {
    TORCH_CHECK(e >= 0 && e < num_experts, "moe_experts: expert id out of range");
    return expert_mlp(x, gate_up_w.slice(e * per, per), down_w.slice(e * per, per), group_size);
  };
  if (T == 1) {
    std::vector<int64_t> order(k);
    for (int64_t j = 0; j < k; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return id[a] < id[b]; });
    at::Tensor out;
    for (const int64_t j : order) {
      const at::Tensor part = expert(id[j], h) * weights.narrow(1, j, 1);
      out = out.defined() ? out + part : part;
    }
    return out;
  }
  std::vector<std::vector<int64_t>> pairs(num_experts);  // expert -> its pairs t * k + j, ascending
  for (int64_t p = 0; p < T * k; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < num_experts, "moe_experts: expert id out of range");
    pairs[id[p]].push_back(p);
  }
  const at::Tensor x = h.contiguous(), flat_weights = weights.reshape({-1}).contiguous();
  TORCH_CHECK(flat_weights.scalar_type() == x.scalar_type(), "moe_experts: weights in h's dtype required");
  at::Tensor out = at::zeros_like(x);
  for (int64_t e = 0; e < num_experts; ++e) {
    if (pairs[e].empty()) continue;
    const at::Tensor rows = at::empty({static_cast<int64_t>(pairs[e].size()), x.size(1)}, x.options());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
      gather_rows<scalar_t>(x, pairs[e], k, rows);
      add_weighted_rows<scalar_t>(expert(e, rows), flat_weights, pairs[e], k, out);
    });
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kiln, m) {
  m.def(
      "decode_layer(Tensor x, Tensor[] qkv_w, Tensor[] o_w, Tensor[] gate_up_w, Tensor[] down_w, int group_size, "
      "Tensor input_norm, Tensor post_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) kv_cache, "
      "Tensor slot_mapping, Tensor[] block_tables, Tensor[] context_lens, int block_size, int num_heads, "
      "int num_kv_heads, int head_dim, Tensor? qkv_bias=None, Tensor? q_norm=None, Tensor? k_norm=None, "
      "int rotary_dim=0, int window=0, float scale=0.0, float softcap=0.0, Tensor? attn_out_norm=None, "
      "Tensor? mlp_out_norm=None, bool gelu=False, Tensor? next_lanes=None) -> Tensor");
  m.def(
      "decode_attention(Tensor x, Tensor[] qkv_w, Tensor[] o_w, int group_size, Tensor input_norm, "
      "Tensor post_norm, float eps, Tensor cos, Tensor sin, Tensor(a!) kv_cache, Tensor slot_mapping, "
      "Tensor[] block_tables, Tensor[] context_lens, int block_size, int num_heads, int num_kv_heads, "
      "int head_dim, Tensor? qkv_bias=None, Tensor? q_norm=None, Tensor? k_norm=None, int rotary_dim=0, "
      "int window=0, float scale=0.0, float softcap=0.0, Tensor? attn_out_norm=None, Tensor? next_lanes=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "moe_experts(Tensor h, Tensor ids, Tensor weights, Tensor[] gate_up_w, Tensor[] down_w, int num_experts, "
      "int group_size) -> Tensor");
  m.def("decode_profile_start() -> ()", decode_profile::start);
  m.def("decode_profile_stop() -> (str[], Tensor)", decode_profile::stop);
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<double, int64_t, int64_t, int64_t, int64_t>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("size", &DecodeStack::size)
      .def("run", &DecodeStack::run)
      .def("set_ends", &DecodeStack::set_ends)
      .def("step", &DecodeStack::step);
}
TORCH_LIBRARY_IMPL(kiln, CPU, m) {
  m.impl("decode_layer", decode_layer);
  m.impl("decode_attention", decode_attention);
  m.impl("moe_experts", moe_experts);
}
