"""Reading a GGUF file's metadata and tensor names as the families need them.

`GGUFMeta` reads `{arch}.`-prefixed keys (llama.cpp writes each family's
hyper-parameters under its architecture name) into ModelArch fields.
`GGUFNaming` is a family's map from llama.cpp tensor names back to the
checkpoint names of its WeightMap, with the changes llama.cpp's converter
made to the values (Q/K rows permuted for the "llama" architecture, 1 added
to Gemma's norms, experts stacked into one 3-d tensor).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGUFReader

from kiln.errors import ModelLoadError

_REQUIRED = object()

# llama.cpp's names of the tensors outside the blocks.
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # absent when tied to the embeddings
}
# llama.cpp block tensor -> HF Llama-style module name (under model.layers.N.).
LLAMA_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


@dataclass(frozen=True)
class GGUFNaming:
    block: dict[str, str]  # llama.cpp block tensor -> HF module under model.layers.N.
    # Stacked experts: llama.cpp tensor -> HF module with {e} for the expert index.
    experts: dict[str, str] = field(default_factory=dict)
    permute_qk: bool = False  # "llama" architecture: convert_hf_to_gguf.py permuted Q/K rows
    norm_offset: float = 0.0  # added by the converter to every norm weight (Gemma: 1)
    metadata_tensors: tuple[str, ...] = ()  # tensors read as hyper-parameters (Phi-3 rope factors)


class GGUFMeta:
    def __init__(self, reader: GGUFReader, path: Path):
        self.reader = reader
        self.path = path
        self.arch_name = str(self.get("general.architecture"))

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field_ = self.reader.get_field(key)
        if field_ is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"missing metadata {key} in GGUF file {self.path}")
            return default
        return field_.contents()

    def arch(self, key: str, default: Any = _REQUIRED) -> Any:
        """The `{architecture}.{key}` value."""
        return self.get(f"{self.arch_name}.{key}", default)

    def has_tensor(self, name: str) -> bool:
        return any(t.name == name for t in self.reader.tensors)

    def tensor_values(self, name: str) -> tuple[float, ...]:
        for t in self.reader.tensors:
            if t.name == name:
                return tuple(float(v) for v in t.data.reshape(-1))
        raise ModelLoadError(f"missing tensor {name} in GGUF file {self.path}")

    def fail(self, what: str) -> ModelLoadError:
        return ModelLoadError(f"{what} in {self.path}")

    def base_fields(self) -> dict[str, Any]:
        """The ModelArch fields every family has, from llama.cpp's standard keys."""
        hidden = int(self.arch("embedding_length"))
        heads = int(self.arch("attention.head_count"))
        head_dim = int(self.arch("attention.key_length", hidden // heads))
        rope_dim = int(self.arch("rope.dimension_count", head_dim))
        return dict(
            vocab_size=self.vocab_size(),
            hidden_size=hidden,
            intermediate_size=int(self.arch("feed_forward_length", 0)),
            num_layers=int(self.arch("block_count")),
            num_heads=heads,
            num_kv_heads=int(self.arch("attention.head_count_kv", heads)),
            head_dim=head_dim,
            # Stored as float32; float() keeps that exact value (as transformers does).
            rms_norm_eps=float(self.arch("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.arch("rope.freq_base", 10000.0)),
            max_position_embeddings=int(self.arch("context_length")),
            tie_word_embeddings=not self.has_tensor("output.weight"),
            bos_token_id=optional_int(self.get("tokenizer.ggml.bos_token_id", None)),
            eos_token_ids=self.eos_ids(),
            rotary_dim=None if rope_dim == head_dim else rope_dim,
        )

    def check_plain_rope(self) -> None:
        scaling = self.arch("rope.scaling.type", "none")
        if scaling != "none":
            raise self.fail(f"unsupported rope scaling type {scaling!r}")
        # llama.cpp stores Llama-3.1 style scaling as per-frequency factors, which
        # ModelArch cannot express (it wants the four RopeScaling parameters).
        if self.has_tensor("rope_freqs.weight"):
            raise self.fail("unsupported rope_freqs tensor (llama3 rope scaling)")

    def vocab_size(self) -> int:
        size = self.arch("vocab_size", None)
        if size is not None:
            return int(size)
        tokens = self.reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise self.fail(f"no {self.arch_name}.vocab_size or tokenizer.ggml.tokens")
        return len(tokens.data)  # one data index per token; avoids decoding the strings

    def eos_ids(self) -> tuple[int, ...]:
        # end-of-turn is a stop token too (Llama-3 GGUFs set both).
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        ids = [optional_int(self.get(k, None)) for k in keys]
        return tuple(dict.fromkeys(i for i in ids if i is not None))

    def sliding_windows(self, is_sliding: list[bool]) -> tuple[int, ...]:
        window = int(self.arch("attention.sliding_window", 0) or 0)
        if not window:
            return ()
        return tuple(window if s else 0 for s in is_sliding)


def optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
