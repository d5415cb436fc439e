"""AWQ 4-bit checkpoints (AutoAWQ's GEMM layout, written here): exact
int4 dequantization, (q - z) * s, and logits equal to transformers' on the
dequantized weights, within the int4 bound of the float model's."""
from __future__ import annotations

import json

import pytest
import torch

from kiln.errors import ModelLoadError
from kiln.llm.models.loader import load_checkpoint
from kiln.llm.quant.int4_cpu import Int4CpuLinear
from tests.unit.llm.quant.formats.compare import check_int4_logits, hf_logits, kiln_model
from tests.unit.llm.quant.formats.writers import is_projection, pack_awq, rtn_int4, write_hf_dir

CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


@pytest.fixture(scope="module")
def awq_dir(tmp_path_factory, tiny_llama_dir, float_model):
    tensors, reference = {}, {}
    for name, w in float_model.state_dict().items():
        if not is_projection(name):
            tensors[name] = w
            continue
        qz = rtn_int4(w, 32, sym=False)
        reference[name] = qz
        for suffix, t in pack_awq(qz).items():
            tensors[name.removesuffix("weight") + suffix] = t
    return write_hf_dir(tmp_path_factory.mktemp("awq"), tiny_llama_dir, tensors, CONFIG), reference


def test_awq_dequantizes_exactly_and_serves_close_to_float(awq_dir, float_model):
    path, reference = awq_dir
    ckpt = load_checkpoint(path)
    assert set(ckpt.quantized) == set(reference)
    for name, qz in reference.items():
        assert ckpt.quantized[name].source == "AWQ"
        assert torch.equal(ckpt.quantized[name].dequantize(), qz.reference()), name
    model = kiln_model(ckpt)
    assert sum(isinstance(m, Int4CpuLinear) for m in model.modules()) == 4 * 2
    assert model.fused_layers is not None  # every projection takes the one-call decode kernel
    exact = hf_logits(float_model, {n: q.reference() for n, q in reference.items()})
    check_int4_logits(model, exact, hf_logits(float_model))


@pytest.mark.parametrize(
    "change,message",
    [
        ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
        ({"bits": 3}, "AWQ with bits 3 is not supported"),
        ({"group_size": 64}, "do not fit group_size 64"),
    ],
)
def test_unsupported_awq_variants_are_refused(awq_dir, tmp_path, change, message):
    path, _ = awq_dir
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**CONFIG, **change}
    copy = tmp_path / "awq"
    copy.mkdir()
    for f in path.iterdir():
        if f.name != "config.json":
            (copy / f.name).symlink_to(f)
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_checkpoint(copy)
