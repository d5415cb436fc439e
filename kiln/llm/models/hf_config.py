"""Reading a Hugging Face config.json into ModelArch fields (shared by the families).

Handles both layouts transformers has written: `rope_theta` / `rope_scaling`
at top level (older) and `rope_parameters` (transformers >= 5, per layer type
for Gemma 3).
"""
from __future__ import annotations

import math
from typing import Any

from kiln.errors import ModelLoadError
from kiln.llm.models.arch import LinearRopeScaling, LongRopeScaling, RopeScaling, RopeVariant

SLIDING = "sliding_attention"


class HFConfig:
    def __init__(self, config: dict[str, Any], source: str):
        self.config = config
        self.source = source

    def need(self, key: str) -> Any:
        if self.config.get(key) is None:
            raise ModelLoadError(f"missing {key} in {self.source}")
        return self.config[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.config.get(key)
        return default if value is None else value

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{what} in {self.source}")

    def base_fields(self, extra_eos_ids: tuple[int, ...] = (), layer_type: str | None = None,
                    tied_by_default: bool = False) -> dict[str, Any]:
        """The ModelArch fields every family has (sizes, rope, special tokens).
        `tied_by_default`: the family's transformers config class ties the head when
        config.json does not say (Gemma's; Google's published configs leave it out)."""
        hidden = int(self.need("hidden_size"))
        heads = int(self.need("num_attention_heads"))
        if heads <= 0:
            raise self.fail(f"num_attention_heads must be positive, got {heads}")
        head_dim = int(self.get("head_dim") or hidden // heads)
        rope = self.rope_parameters(layer_type)
        return dict(
            vocab_size=int(self.need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(self.need("intermediate_size")),
            num_layers=int(self.need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=int(self.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(self.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            max_position_embeddings=int(self.get("max_position_embeddings", 2048)),
            # Llama's default (False); Llama-3.2 and SmolLM configs say True explicitly.
            tie_word_embeddings=bool(self.get("tie_word_embeddings", tied_by_default)),
            rope_scaling=self.rope_scaling(rope, head_dim),
            bos_token_id=self.config.get("bos_token_id"),
            eos_token_ids=unique(as_ids(self.config.get("eos_token_id")) + extra_eos_ids),
            rotary_dim=self.rotary_dim(rope, head_dim),
        )

    def rope_parameters(self, layer_type: str | None = None) -> dict[str, Any]:
        """transformers>=5 writes `rope_parameters` (theta inside; per layer
        type for Gemma 3); older configs have `rope_theta` and `rope_scaling`
        at top level."""
        rope = dict(self.config.get("rope_scaling") or {})
        params = dict(self.config.get("rope_parameters") or {})
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = dict(params[layer_type])
        elif any(isinstance(v, dict) for v in params.values()):
            params = {}
        rope.update(params)
        if "rope_theta" in self.config and "rope_theta" not in rope:
            rope["rope_theta"] = self.config["rope_theta"]
        for key in ("partial_rotary_factor", "original_max_position_embeddings"):
            if key in self.config and key not in rope:
                rope[key] = self.config[key]
        return rope

    def rope_scaling(self, rope: dict[str, Any], head_dim: int) -> RopeVariant | None:
        # Old configs spell the key "type"; Phi-3's first configs say "su" for LongRoPE.
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        try:
            if rope_type in (None, "default"):
                return None
            if rope_type == "llama3":
                return RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                )
            if rope_type == "linear":
                return LinearRopeScaling(float(rope["factor"]))
            if rope_type in ("longrope", "su"):
                return self._long_rope(rope, head_dim)
        except KeyError as e:
            raise self.fail(f"{rope_type} rope_scaling lacks {e.args[0]}") from e
        raise self.fail(f"unsupported rope_scaling type {rope_type!r}")

    def _long_rope(self, rope: dict[str, Any], head_dim: int) -> LongRopeScaling:
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or int(self.get("max_position_embeddings", original)) / original
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:  # as transformers and llama.cpp derive it
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        scaling = LongRopeScaling(
            short_factor=tuple(float(f) for f in rope["short_factor"]),
            long_factor=tuple(float(f) for f in rope["long_factor"]),
            original_max_position_embeddings=original,
            attention_factor=float(attention_factor),
        )
        half = (self.rotary_dim(rope, head_dim) or head_dim) // 2
        if len(scaling.short_factor) != half or len(scaling.long_factor) != half:
            raise self.fail(f"longrope factors must have {half} entries (half the rotary dims)")
        return scaling

    @staticmethod
    def rotary_dim(rope: dict[str, Any], head_dim: int) -> int | None:
        factor = float(rope.get("partial_rotary_factor", 1.0))
        return None if factor == 1.0 else int(head_dim * factor)

    def layer_windows(self, default_types: list[str] | None = None) -> tuple[int, ...]:
        """Sliding window per layer from `layer_types` (written by transformers >= 4.54),
        else `default_types` (the family's rule), else every layer when
        `sliding_window` is set; () when no layer slides."""
        window = self.config.get("sliding_window")
        if not window:
            return ()
        layers = int(self.need("num_hidden_layers"))
        types = self.config.get("layer_types") or default_types or [SLIDING] * layers
        if len(types) != layers:
            raise self.fail(f"layer_types has {len(types)} entries for {layers} layers")
        windows = tuple(int(window) if t == SLIDING else 0 for t in types)
        return windows if any(windows) else ()


def as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def unique(ids: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(ids))
