"""What the families share: WeightMap builders for the Llama-shaped parts
and the checks every config reader makes."""
from __future__ import annotations

from kiln.llm.models.arch import ModelArch
from kiln.llm.models.hf_config import HFConfig
from kiln.llm.models.weight_map import WeightMap


def norm_offset(arch: ModelArch) -> float:
    """What loading adds to a norm weight: 1 where the norm multiplies by (1 + w)."""
    return 1.0 if arch.norm_plus_one else 0.0


def embeddings_and_head(m: WeightMap, arch: ModelArch) -> None:
    h, v = arch.hidden_size, arch.vocab_size
    m.add("embed_tokens", ("model.embed_tokens.weight", (v, h)))
    if not arch.tie_word_embeddings:
        m.add("lm_head", ("lm_head.weight", (v, h)))
    m.add("norm.weight", ("model.norm.weight", (h,)), offset=norm_offset(arch))


def attention(m: WeightMap, arch: ModelArch, layer: int, fused_qkv: bool = False) -> None:
    """q|k|v (from q_proj, k_proj, v_proj, or one qkv_proj), their biases, o_proj, q/k norms."""
    p, k = f"model.layers.{layer}.self_attn.", f"layers.{layer}.self_attn."
    h, q, kv, d = arch.hidden_size, arch.q_size, arch.kv_size, arch.head_dim
    if fused_qkv:
        m.add(k + "qkv_proj.weight", (p + "qkv_proj.weight", (q + 2 * kv, h)))
    else:
        m.add(k + "qkv_proj.weight", (p + "q_proj.weight", (q, h)), (p + "k_proj.weight", (kv, h)),
              (p + "v_proj.weight", (kv, h)))
    if arch.attention_bias:
        m.add(k + "qkv_bias", (p + "q_proj.bias", (q,)), (p + "k_proj.bias", (kv,)), (p + "v_proj.bias", (kv,)))
    m.add(k + "o_proj.weight", (p + "o_proj.weight", (h, q)))
    if arch.qk_norm:
        m.add(k + "q_norm.weight", (p + "q_norm.weight", (d,)), offset=norm_offset(arch))
        m.add(k + "k_norm.weight", (p + "k_norm.weight", (d,)), offset=norm_offset(arch))


def gated_mlp(
    m: WeightMap, arch: ModelArch, kiln: str, hf: str, intermediate: int,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> None:
    """gate|up and down of one gated MLP: Kiln module `kiln`, checkpoint module `hf`."""
    h = arch.hidden_size
    gate, up, down = (f"{hf}.{n}.weight" for n in names)
    m.add(f"{kiln}.gate_up_proj.weight", (gate, (intermediate, h)), (up, (intermediate, h)))
    m.add(f"{kiln}.down_proj.weight", (down, (h, intermediate)))


def layer_norms(m: WeightMap, arch: ModelArch, layer: int, names: tuple[str, ...]) -> None:
    """The layer's RMSNorms, named alike in Kiln and the checkpoint."""
    for name in names:
        m.add(f"layers.{layer}.{name}.weight", (f"model.layers.{layer}.{name}.weight", (arch.hidden_size,)),
              offset=norm_offset(arch))


LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")


def llama_weight_map(arch: ModelArch, fused: bool = False) -> WeightMap:
    """Llama's naming (and Mistral's, Qwen2's, Qwen3's; Phi-3's with `fused`
    q|k|v and gate|up in the checkpoint)."""
    m = WeightMap()
    embeddings_and_head(m, arch)
    for i in range(arch.num_layers):
        attention(m, arch, i, fused_qkv=fused)
        if fused:
            p, h, inter = f"model.layers.{i}.mlp.", arch.hidden_size, arch.intermediate_size
            m.add(f"layers.{i}.mlp.gate_up_proj.weight", (p + "gate_up_proj.weight", (2 * inter, h)))
            m.add(f"layers.{i}.mlp.down_proj.weight", (p + "down_proj.weight", (h, inter)))
        else:
            gated_mlp(m, arch, f"layers.{i}.mlp", f"model.layers.{i}.mlp", arch.intermediate_size)
        layer_norms(m, arch, i, LLAMA_NORMS)
    return m


def require_silu(config: HFConfig) -> None:
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise config.fail(f"unsupported hidden_act {act!r}")


def reject_biases(config: HFConfig) -> None:
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise config.fail("unsupported attention/MLP biases")
