"""FP8 (e4m3) checkpoints, written here in compressed-tensors' and
transformers' "fp8" layouts: Kiln dequantizes them once at load to exactly
the reference dequantization, weight.to(scale dtype) * scale (rounded to
bf16 where the scales are bf16, as the reference computes in that dtype),
and serves logits equal to transformers' on those weights."""
from __future__ import annotations

import pytest
import torch

from kiln.errors import ModelLoadError
from kiln.llm.layers.linear import Linear
from kiln.llm.models.loader import load_checkpoint
from tests.unit.llm.quant.formats.compare import FP8_BOUND, hf_logits, kiln_logits, kiln_model, relative_error
from tests.unit.llm.quant.formats.writers import is_projection, write_hf_dir

FP8_MAX = 448.0


def compressed_tensors_config(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False}
    activations = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
    return {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
        "ignore": ["lm_head"],
    }


def scales_for(w: torch.Tensor, layout: str, block: int = 32) -> torch.Tensor:
    """The per-tensor [1], per-channel [N, 1] or per-block [N/b, K/b] scale of w (amax / 448)."""
    if layout == "tensor":
        return (w.abs().amax() / FP8_MAX).reshape(1)
    if layout == "channel":
        return w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    n, k = w.shape
    return w.abs().reshape(n // block, block, k // block, block).amax(dim=(1, 3)) / FP8_MAX


def expand(scale: torch.Tensor, shape: torch.Size, block: int = 32) -> torch.Tensor:
    if scale.dim() == 2 and scale.shape[1] > 1:
        return scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
    return scale.expand(shape) if scale.dim() == 2 else scale.reshape(()).expand(shape)


def fp8_checkpoint(tmp_path, base, model, layout: str, scale_dtype: torch.dtype,
                   fp8_dtype: torch.dtype = torch.float8_e4m3fn):
    tensors, reference = {}, {}
    block_layout = layout == "block"
    scale_name = "weight_scale_inv" if block_layout else "weight_scale"
    for name, w in model.state_dict().items():
        if not is_projection(name):
            tensors[name] = w
            continue
        scale = scales_for(w, layout).to(scale_dtype)
        q = (w / expand(scale.float(), w.shape)).clamp(-FP8_MAX, FP8_MAX).to(fp8_dtype)
        prefix = name.removesuffix("weight")
        tensors[name] = q
        tensors[prefix + scale_name] = scale
        if not block_layout:
            tensors[prefix + "input_scale"] = torch.ones(1)  # static activation scale: not used by Kiln
        # The reference: compressed-tensors' / transformers' dequantize, in the scale's dtype.
        reference[name] = q.to(scale_dtype) * expand(scale, w.shape)
    config = (
        {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}
        if block_layout else compressed_tensors_config(layout)
    )
    return write_hf_dir(tmp_path / f"{layout}-{scale_dtype}-{fp8_dtype}", base, tensors, config), reference


@pytest.mark.parametrize(
    "layout,scale_dtype", [("tensor", torch.float32), ("channel", torch.float32), ("channel", torch.bfloat16),
                           ("block", torch.float32)],
)
def test_fp8_dequantizes_exactly_and_serves_close_to_float(tmp_path, tiny_llama_dir, float_model, layout,
                                                           scale_dtype):
    path, reference = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, layout, scale_dtype)
    ckpt = load_checkpoint(path)
    assert not ckpt.quantized  # dequantized at load, kept float
    for name, ref in reference.items():
        got = ckpt.weights[name]
        assert got.dtype == torch.float32
        assert torch.equal(got.to(scale_dtype), ref), name
    assert not any(n.endswith(("input_scale", "weight_scale", "weight_scale_inv")) for n in ckpt.weights)
    model = kiln_model(ckpt)
    assert sum(isinstance(m, Linear) for m in model.modules()) == 4 * 2
    out = kiln_logits(model)
    exact = hf_logits(float_model, {n: ckpt.weights[n] for n in reference})
    torch.testing.assert_close(out, exact, rtol=0, atol=1e-4 * exact.abs().max().item())
    assert relative_error(out, hf_logits(float_model)) < FP8_BOUND


def test_fp8_takes_the_engines_int8_quantization(tmp_path, tiny_llama_dir, float_model):
    from kiln.llm.quant.int8 import Int8Linear

    path, _ = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, "channel", torch.float32)
    model = kiln_model(load_checkpoint(path), quantization="int8")
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 4 * 2 + 1  # and the head


def test_int4_compressed_tensors_is_refused_by_name(tmp_path, tiny_llama_dir, float_model):
    path, _ = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, "channel", torch.float32)
    import json

    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["format"] = "pack-quantized"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="compressed-tensors format 'pack-quantized' is not supported"):
        load_checkpoint(path)


def test_e5m2_weights_are_scaled_too(tmp_path, tiny_llama_dir, float_model):
    # float8_e5m2 weights loaded with no error and their scales dropped: logprobs off by 1.85.
    path, reference = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, "block", torch.float32,
                                     fp8_dtype=torch.float8_e5m2)
    ckpt = load_checkpoint(path)
    for name, ref in reference.items():
        assert torch.equal(ckpt.weights[name], ref), name


@pytest.mark.parametrize("layout,change,message", [
    # Each was a KeyError / AttributeError / TypeError / ValueError traceback.
    ("channel", {"strategy": "group"}, "group strategy needs a positive group_size, got None"),
    ("block", {"weight_block_size": 128}, r"weight_block_size must be \[rows, cols\] of positive integers, got 128"),
    ("block", {"weight_block_size": [128]}, r"weight_block_size must be \[rows, cols\]"),
    ("channel", {"config_groups": [{"weights": {}}]}, "config_groups must map group names to objects"),
    ("channel", {"config_groups": {}}, "config_groups describe no weights"),
])
def test_malformed_fp8_settings_are_load_errors(tmp_path, tiny_llama_dir, float_model, layout, change, message):
    import json

    path, _ = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, layout, torch.float32)
    config = json.loads((path / "config.json").read_text())
    qc = config["quantization_config"]
    if "strategy" in change:
        qc["config_groups"]["group_0"]["weights"].update(change)
    else:
        qc.update(change)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(path)


def test_fp8_tensors_the_config_does_not_explain_are_refused(tmp_path, tiny_llama_dir, float_model):
    import json

    from safetensors.torch import load_file, save_file

    path, _ = fp8_checkpoint(tmp_path, tiny_llama_dir, float_model, "channel", torch.float32)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]  # a torch "Promotion for Float8 Types" error, or unscaled weights
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=r"is stored as torch.float8_e4m3fn, but config.json has no "
                                             r"quantization_config"):
        load_checkpoint(path)

    path, _ = fp8_checkpoint(tmp_path / "float", tiny_llama_dir, float_model, "channel", torch.float32)
    (file,) = path.glob("*.safetensors")
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name].float()  # a float weight with a scale beside it: the scale was dropped
    save_file(tensors, file)
    with pytest.raises(ModelLoadError, match=r"down_proj.weight_scale scales a torch.float32 weight"):
        load_checkpoint(path)
