"""GPTQ 4-bit checkpoints, written here from the tiny Llama in AutoGPTQ's
layout: Kiln keeps every projection as int4 whose dequantization equals the
format's, (q - z) * s, bit for bit (and AutoGPTQ's own fp16 evaluation of it
after rounding to fp16); the model's logits equal transformers' on those
dequantized weights up to float rounding, and stay within the int4 bound of
the float model's."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from kiln.errors import ConfigError, ModelLoadError
from kiln.llm.layers.linear import Linear
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant.formats.int4_weight import Int4Weight, PermutedInput
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from tests.unit.llm.quant.formats.compare import check_int4_logits, hf_logits, kiln_model
from tests.unit.llm.quant.formats.writers import Quantized, is_projection, pack_gptq, rtn_int4, write_hf_dir

CASES = {
    # name: (group_size, sym, act_order, checkpoint_format)
    "asym-g32": (32, False, False, "gptq"),
    "sym-g32-act-order": (32, True, True, "gptq"),
    "asym-per-row-v2": (-1, False, False, "gptq_v2"),
}


def input_of(name: str) -> str:
    """Which input a projection reads: q, k and v share one, gate and up another."""
    layer, _, projection = name.removesuffix(".weight").rpartition(".")
    shared = {"q_proj": "attn", "k_proj": "attn", "v_proj": "attn", "gate_proj": "mlp", "up_proj": "mlp"}
    return f"{layer}:{shared.get(projection, projection)}"


def gptq_checkpoint(tmp_path, base, model: LlamaForCausalLM, case: str, shared_perm: bool = True):
    group, sym, act_order, fmt = CASES[case]
    state = model.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    reference: dict[str, Quantized] = {}
    gen = torch.Generator().manual_seed(1)
    perms: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if not is_projection(name):
            tensors[name] = w
            continue
        k = w.shape[1]
        g = k if group == -1 else group
        perm = None
        if act_order:  # projections of one input (q|k|v, gate|up) share GPTQ's order
            key = input_of(name) if shared_perm else name
            if key not in perms:
                perms[key] = torch.randperm(k, generator=gen)
            perm = perms[key]
        qz = rtn_int4(w, g, sym, perm, min_zero=1 if fmt == "gptq" else 0)  # v1 cannot store z = 0
        reference[name] = qz
        prefix = name.removesuffix(".weight")
        for suffix, t in pack_gptq(qz, zero_offset=1 if fmt == "gptq" else 0).items():
            tensors[f"{prefix}.{suffix}"] = t
    config = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order, "sym": sym,
              "checkpoint_format": fmt}
    return write_hf_dir(tmp_path / case, base, tensors, config), reference


@pytest.mark.parametrize("case", list(CASES))
def test_gptq_dequantizes_exactly_and_serves_close_to_float(tmp_path, tiny_llama_dir, float_model, case):
    path, reference = gptq_checkpoint(tmp_path, tiny_llama_dir, float_model, case)
    ckpt = load_checkpoint(path)
    assert set(ckpt.quantized) == set(reference)
    for name, qz in reference.items():
        got = ckpt.quantized[name]
        assert isinstance(got, Int4Weight) and got.source == "GPTQ"
        ref = qz.reference()
        assert torch.equal(got.dequantize(), ref), name
        # AutoGPTQ's torch path evaluates scales * (q - z) in fp16: the same value, rounded once.
        fp16 = qz.scale.half()[:, qz.g_idx] * (qz.q - qz.zero[:, qz.g_idx]).half()
        assert torch.equal(got.dequantize().half(), fp16), name
    sym = CASES[case][1]
    dtypes = {q.scale_min.dtype for q in ckpt.quantized.values()}
    assert dtypes == ({torch.float16} if sym else {torch.float32})  # -8s is exact in fp16, -z*s is not

    model = kiln_model(ckpt)
    projections = [m for m in model.modules() if isinstance(m, (Int4CpuLinear, PermutedInput))]
    assert not any(isinstance(m, Linear) for m in model.modules())
    exact = hf_logits(float_model, {n: q.reference() for n, q in reference.items()})
    check_int4_logits(model, exact, hf_logits(float_model))
    if CASES[case][2]:  # act-order: every projection permutes its input, q|k|v and gate|up fused
        assert sum(isinstance(m, PermutedInput) for m in projections) == 4 * 2
        assert model.fused_layers is None  # the one-call decode kernel does not permute


def test_act_order_pieces_with_different_orders_fuse_in_float(tmp_path, tiny_llama_dir, float_model):
    path, reference = gptq_checkpoint(tmp_path, tiny_llama_dir, float_model, "sym-g32-act-order", shared_perm=False)
    ckpt = load_checkpoint(path)
    model = kiln_model(ckpt)
    layer = model.decoder_layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Linear)  # q, k, v orders differ: dequantized, exact
    qkv = torch.cat([reference[f"model.layers.0.self_attn.{n}_proj.weight"].reference() for n in "qkv"])
    assert torch.equal(layer.self_attn.qkv_proj.weight, qkv)
    assert isinstance(layer.self_attn.o_proj, PermutedInput)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"bits": 8}, "GPTQ with bits 8 is not supported"),
        ({"bits": "4"}, "GPTQ with bits '4' is not supported"),
        # Each was a ValueError / TypeError traceback (`kiln generate` exit 1).
        ({"group_size": "abc"}, r"invalid quantization_config in config.json \(ValueError: "),
        ({"group_size": None}, r"invalid quantization_config in config.json \(TypeError: "),
        ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not supported"),
    ],
)
def test_unsupported_gptq_variants_are_refused_by_name(tmp_path, tiny_llama_dir, float_model, change, message):
    import json

    path, _ = gptq_checkpoint(tmp_path, tiny_llama_dir, float_model, "asym-g32")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path)


def test_tensor_parallel_refuses_a_gptq_directory(tmp_path, tiny_llama_dir, float_model):
    from kiln.llm.parallel.weights import open_weights

    path, _ = gptq_checkpoint(tmp_path, tiny_llama_dir, float_model, "asym-g32")
    with pytest.raises(ConfigError, match=r"pre-quantized checkpoint \(gptq\).*tensor or pipeline parallelism"):
        open_weights(str(path))


def test_packed_tensors_of_another_dtype_and_a_projection_stored_twice_are_refused(tmp_path, tiny_llama_dir,
                                                                                   float_model):
    # A float32 qweight was truncated into codes, and a projection stored as both .weight and .qweight lost
    # its float copy, each in silence.
    from safetensors.torch import load_file, save_file

    for case in ("float-qweight", "both"):
        path, _ = gptq_checkpoint(tmp_path / case, tiny_llama_dir, float_model, "asym-g32")
        (file,) = path.glob("*.safetensors")
        tensors = load_file(file)
        prefix = "model.layers.0.mlp.down_proj"
        if case == "float-qweight":
            tensors[prefix + ".qweight"] = tensors[prefix + ".qweight"].float()
            message = r"down_proj.weight: GPTQ qweight is stored as torch.float32, not int32 words"
        else:
            tensors[prefix + ".weight"] = torch.zeros(float_model.config.hidden_size,
                                                      float_model.config.intermediate_size)
            message = r"model.layers.0.mlp.down_proj is stored both as .*down_proj.weight and as GPTQ tensors"
        save_file(tensors, file)
        with pytest.raises(ModelLoadError, match=message):
            load_checkpoint(path)
