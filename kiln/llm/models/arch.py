"""Architecture hyper-parameters of a decoder-only model, as Kiln needs them.

Every family's reader (Hugging Face config.json, GGUF metadata; see
kiln/llm/models/families/) produces a `ModelArch`; the model code reads
nothing else. The defaults are Llama's, so a Llama arch names only its
sizes; the other fields carry what the families vary (attention biases, q/k
norms, (1+w) and sandwich norms, activation, embedding scale, soft-capping,
sliding windows per layer, rope variants, mixture-of-experts shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency scaling (rope_type == "llama3")."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class LinearRopeScaling:
    """Positions divided by `factor` (rope_type == "linear"; Gemma 3's global layers)."""

    factor: float


@dataclass(frozen=True)
class LongRopeScaling:
    """Phi-3 LongRoPE: per-frequency divisors and a cos/sin multiplier.

    Which factors apply is decided once per engine, from its context length
    (`long_factor` when it exceeds `original_max_position_embeddings`, as
    llama.cpp decides from n_ctx), so a sequence's keys never mix the two.
    transformers decides per forward call from the longest position in it.
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float


RopeVariant = RopeScaling | LinearRopeScaling | LongRopeScaling


@dataclass(frozen=True)
class MoEShape:
    """A sparse mixture-of-experts MLP: `top_k` of `num_experts` SwiGLU experts per token."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    # Divide the chosen experts' router probabilities by their sum (Mixtral
    # always; Qwen3-MoE when norm_topk_prob).
    renormalize: bool
    # Layers with a dense MLP (`intermediate_size` of the arch) instead (Qwen3-MoE mlp_only_layers).
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # Checked here, so a checkpoint that says otherwise fails its load, not every request.
        if self.num_experts <= 0 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"experts per token ({self.top_k}) must be between 1 and the number of experts "
                             f"({self.num_experts})")
        if self.intermediate_size <= 0:
            raise ValueError(f"the experts' intermediate size must be positive, got {self.intermediate_size}")


ACTIVATIONS = ("silu", "gelu_tanh")


@dataclass(frozen=True)
class ModelArch:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: RopeVariant | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # The registry name of the family whose model and weight names this is.
    family: str = "llama"
    # --- attention
    attention_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rope (Qwen3, Gemma 3)
    query_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    # Sliding-window size per layer (0: the layer attends to the whole
    # context); empty: every layer global. A query at position p attends to
    # keys at p - window + 1 .. p.
    layer_windows: tuple[int, ...] = ()
    rotary_dim: int | None = None  # rotated leading dims of a head; None: all (Phi-4-mini: 3/4)
    # Rope base of the sliding-window layers, unscaled (Gemma 3); None: as the others.
    local_rope_theta: float | None = None
    # --- norms and MLP
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + w) (Gemma); folded into w at load
    sandwich_norms: bool = False  # extra norms after attention and around the MLP (Gemma 2/3)
    hidden_act: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_tanh (GeGLU)
    embed_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden))
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    moe: MoEShape | None = None

    def __post_init__(self) -> None:
        """Sizes the model's math needs, checked at load (a checkpoint that breaks them loaded,
        then every request failed with a torch error)."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"the attention heads ({self.num_heads}) must be a multiple of the key/value heads "
                             f"({self.num_kv_heads})")
        rotary = self.head_dim if self.rotary_dim is None else self.rotary_dim
        if rotary % 2 or not 0 < rotary <= self.head_dim:
            raise ValueError(f"the rotated dims of a head ({rotary}) must be even and at most head_dim "
                             f"({self.head_dim})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        """Sliding-window size of `layer`, 0 for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else 0

    @property
    def has_sliding_window(self) -> bool:
        return any(self.layer_windows)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer not in self.moe.dense_layers

    @property
    def is_plain_llama(self) -> bool:
        """Llama's math exactly (what tensor parallelism and the Llama-only paths take)."""
        return self == ModelArch(
            **{f: getattr(self, f) for f in _SIZE_FIELDS}, family=self.family,
        ) and not isinstance(self.rope_scaling, LinearRopeScaling | LongRopeScaling)


_SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
    "rms_norm_eps", "rope_theta", "max_position_embeddings", "tie_word_embeddings", "rope_scaling", "bos_token_id",
    "eos_token_ids",
)

# The name every caller used before the families: a Llama arch is a ModelArch with the defaults.
LlamaArch = ModelArch
