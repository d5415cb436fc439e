"""How the format tests compare a pre-quantized load with the float model."""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from unittest import mock

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kiln.config import EngineConfig
from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.engine.builder import build_model
from kiln.llm.kernels import ops
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.quant import int4_cpu

IDS = list(range(100, 132))
# Logits against the float model, relative to their largest magnitude: the
# bound tests/unit/llm/quant/test_apply.py holds Kiln's own int4 to on random
# weights (on this model Kiln's int4 measures 0.11, its int8 0.008). FP8 e4m3
# keeps 3 mantissa bits (rounding up to 1/16 of each weight, where int8 rounds
# by at most 1/254 of its row's largest), so its bound lies between: twice the
# 0.03 that test_apply allows int8 (measured here: 0.029-0.035).
INT4_BOUND, FP8_BOUND = 0.25, 0.06
# Kiln's int4 kernel with int8 activations (linear_w4a8, not the default):
# its logits against the default's, relative to their largest magnitude
# (measured here, over the format tests: 0.006-0.012).
INT8_ACTIVATIONS_BOUND = 0.03


@contextmanager
def int8_activations() -> Iterator[None]:
    """Kiln's int4 layers on linear_w4a8 (x quantized to int8 in groups of 32)."""
    with mock.patch.object(int4_cpu, "linear_w4", ops.linear_w4a8):
        yield


def small_llama(hidden_size: int) -> LlamaForCausalLM:
    """A seeded 2-layer float Llama (vocab 512, MLP twice as wide), untied, no tokenizer needed."""
    config = LlamaConfig(vocab_size=512, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def hf_logits(model: LlamaForCausalLM, state: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
    """transformers' logits for IDS, with `state` loaded over the model's weights if given."""
    if state is not None:
        replaced = LlamaForCausalLM(model.config).eval()
        replaced.load_state_dict({**model.state_dict(), **state})
        model = replaced
    with torch.inference_mode():
        return model(torch.tensor([IDS])).logits[0].float()


def kiln_model(ckpt: Checkpoint, **options):
    # float32 unless asked: the references are float32 transformers (auto is bf16 on AVX512_BF16 CPUs).
    config = EngineConfig.from_flat(model=ckpt.source, **{"dtype": "float32", **options})
    return build_model(ckpt, config, max_model_len=64)


def kiln_logits(model) -> torch.Tensor:
    a, n = model.arch, len(IDS)
    kv = [torch.zeros(2, n, a.num_kv_heads, a.head_dim) for _ in range(a.num_layers)]
    pos = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=pos, block_size=n, prefills=[PrefillSeq(0, n, n, None)])
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(IDS), pos, kv, meta))


def check_int4_logits(model, exact: torch.Tensor, float_logits: torch.Tensor) -> None:
    """Kiln's logits equal `exact` (transformers on the dequantized weights),
    within the int4 bound of the float model's, and near them with int8
    activations (linear_w4a8)."""
    out = kiln_logits(model)
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-4 * exact.abs().max().item())
    assert relative_error(out, float_logits) < INT4_BOUND
    with int8_activations():
        assert relative_error(kiln_logits(model), exact) < INT8_ACTIVATIONS_BOUND


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())
