"""LlamaModel.finish with a quantization swaps every Linear and gives the LM
head a quantized copy; the model's outputs stay close to the float model's."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kiln.config import ModelConfig
from kiln.errors import ConfigError
from kiln.llm.attention.metadata import AttentionMetadata, PrefillSeq
from kiln.llm.kernels.ops import kernels_loaded
from kiln.llm.layers.linear import Linear
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.llama import LlamaModel
from kiln.llm.quant.int4 import Int4Linear
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from kiln.llm.quant.int8 import Int8Linear

# On CPU int4 takes Kiln's kernel format where the library is built, else torch's.
INT4 = Int4CpuLinear if kernels_loaded() else Int4Linear

ARCH = LlamaArch(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
    tie_word_embeddings=True, rope_scaling=None, bos_token_id=1, eos_token_ids=(2,),
)


CPU = torch.device("cpu")


def finished(model, method, group_size=32, **head):
    return model.finish(CPU, torch.float32, method, group_size, **head)


def random_model(tied=True):
    torch.manual_seed(0)
    model = LlamaModel(dataclasses.replace(ARCH, tie_word_embeddings=tied), max_positions=64)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    for name, p in model.named_parameters():
        if "layernorm" in name or name == "norm.weight":
            p.data.fill_(1.0)
    return model


def logits(model, n=12):
    a = model.arch
    kv = [torch.zeros(2, n, a.num_kv_heads, a.head_dim) for _ in range(a.num_layers)]
    pos = torch.arange(n)
    meta = AttentionMetadata(slot_mapping=pos, block_size=n, prefills=[PrefillSeq(0, n, n, None)])
    with torch.inference_mode():
        return model.compute_logits(model(torch.arange(3, 3 + n), pos, kv, meta))


@pytest.mark.parametrize("method,cls,rtol", [("int8", Int8Linear, 0.03), ("int4", INT4, 0.25)])
@pytest.mark.parametrize("tied", [True, False])
def test_every_linear_and_the_head_are_quantized(method, cls, rtol, tied):
    model = random_model(tied)
    ref = logits(model)
    finished(model, method)
    assert not any(isinstance(m, Linear) for m in model.modules())
    assert sum(isinstance(m, cls) for m in model.modules()) == 4 * ARCH.num_layers + (cls is Int8Linear)
    assert isinstance(model.logits_head, Int8Linear)  # the head is int8 in both modes
    assert model.embed_tokens.shape == (ARCH.vocab_size, ARCH.hidden_size)  # lookup table stays float
    if not tied:
        assert model.lm_head.numel() == 0  # the untied float head is released
    out = logits(model)
    # relative to the logits' spread: int8 ~1%, int4 (32-groups) ~10% on random weights
    assert (out - ref).abs().max() <= rtol * ref.abs().max()


def test_none_leaves_the_model_alone():
    model = random_model()
    finished(model, None)
    assert model.logits_head is None
    assert sum(isinstance(m, Linear) for m in model.modules()) == 4 * ARCH.num_layers


def test_int4_head_on_request_and_float_head():
    model = random_model()
    finished(model, "int4", head_quantization="int4")
    assert isinstance(model.logits_head, INT4)
    model = random_model()
    finished(model, "int8", head_quantization=None)
    assert model.logits_head is None


def test_int4_unsupported_shapes_stay_float():
    model = random_model()
    # hidden 64 is not a multiple of 128, intermediate 128 is
    finished(model, "int4", group_size=128, head_quantization="int4")
    assert sum(isinstance(m, Linear) for m in model.modules()) == 3 * ARCH.num_layers
    assert all(isinstance(layer.mlp.down_proj, INT4) for layer in model.layers)
    assert model.logits_head is None


@pytest.mark.parametrize("bad", ["int2", "INT8", "fp8", ""])
def test_bad_quantization_is_a_config_error_naming_the_parameter(bad):
    with pytest.raises(ConfigError) as info:
        ModelConfig(quantization=bad)
    assert info.value.param == "quantization"
    assert "quantization" in info.value.message


def test_float_is_a_mode_and_only_int8_int4_refuse_parallelism():
    from kiln.config import EngineConfig

    assert EngineConfig.from_flat(quantization="float").model.quantization == "float"
    assert EngineConfig.from_flat(quantization="float", tensor_parallel_size=2).parallel.world_size == 2
    for method in ("int8", "int4"):
        with pytest.raises(ConfigError, match="not supported with tensor or pipeline parallelism") as info:
            EngineConfig.from_flat(quantization=method, tensor_parallel_size=2)
        assert info.value.param == "quantization"


def test_int8_activations_outside_float32_cpu_single_process_are_config_errors():
    from kiln.config import EngineConfig

    for options in ({"dtype": "bfloat16"}, {"device": "cuda"}, {"tensor_parallel_size": 2}):
        with pytest.raises(ConfigError, match="int4_activations int8 applies to float32 models") as info:
            EngineConfig.from_flat(int4_activations="int8", **options)
        assert info.value.param == "int4_activations"
    assert EngineConfig.from_flat(int4_activations="int8").model.int4_activations == "int8"
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(int4_activations="int4")
    assert info.value.param == "int4_activations"


def test_bad_group_size_is_a_config_error():
    with pytest.raises(ConfigError) as info:
        ModelConfig(quantization="int4", quant_group_size=48)
    assert info.value.param == "quant_group_size"


def test_flat_options_and_cli_flag_reach_the_config():
    from kiln.cli.main import build_parser, given
    from kiln.config import EngineConfig

    assert EngineConfig.from_flat(quantization="int4", quant_group_size=64).model.quantization == "int4"
    parser, names = build_parser()
    for command in ("serve", "generate"):
        for method in ("int8", "float"):
            argv = [command, "--quantization", method] + (["--prompt", "hi"] if command == "generate" else [])
            args = parser.parse_args(argv)
            assert given(args, names["engine"])["quantization"] == method


def test_quantize_head_none_returns_to_the_float_head_only_while_it_exists():
    model = finished(random_model(tied=True), "int8")
    assert isinstance(model.logits_head, Int8Linear)
    model.quantize_head(None)
    assert model.logits_head is None
    hidden = torch.randn(3, ARCH.hidden_size)
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, model.embed_tokens))
    untied = finished(random_model(tied=False), "int8")
    with pytest.raises(ValueError, match="released"):
        untied.quantize_head(None)
