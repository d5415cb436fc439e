"""The model dtype with a pre-quantized checkpoint's int4 projections: on CPU
`auto` keeps float32 there, where they compute the same bits at every batch
size (in bfloat16, faster for batches, up to 8 rows and more rows take
different kernels and weights rounded differently: kiln/llm/engine/builder.py);
an explicit 16-bit dtype is honoured like any other. (It used to be refused for a
supposed prefix-cache defect that was a near-tie flipped by 16-bit rounding:
tests/integration/llm/test_numerics.py.)"""
import pytest

from kiln.config import EngineConfig
from kiln.llm.engine import builder
from kiln.llm.models.dtype_choice import DtypeChoice


def test_auto_keeps_float32_for_stored_int4_on_cpu(monkeypatch):
    monkeypatch.setattr(builder, "choose_dtype", lambda *a: DtypeChoice("bfloat16", "this CPU has bf16"))
    auto = EngineConfig.from_flat(dtype="auto")
    assert builder.resolve_dtype(auto, None, keeps_int4=True).model.dtype == "float32"
    assert builder.resolve_dtype(auto, None, keeps_int4=False).model.dtype == "bfloat16"


def test_auto_without_bf16_stays_float32(monkeypatch):
    monkeypatch.setattr(builder, "choose_dtype", lambda *a: DtypeChoice("float32", "no bf16 here"))
    auto = EngineConfig.from_flat(dtype="auto")
    assert builder.resolve_dtype(auto, None, keeps_int4=True).model.dtype == "float32"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_with_stored_int4_is_honoured(dtype):
    config = EngineConfig.from_flat(dtype=dtype)
    assert builder.resolve_dtype(config, None, keeps_int4=True).model.dtype == dtype
