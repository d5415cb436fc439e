"""The model dtype with a pre-quantized checkpoint's int4 projections: 16-bit
activations through them are a known defect on CPU (wrong logits for prefill
chunks after a prefix-cache hit), so `auto` keeps float32 and an explicit
16-bit dtype is refused by name."""
import pytest

from kiln.config import EngineConfig
from kiln.errors import ConfigError
from kiln.llm.engine import builder
from kiln.llm.models.dtype_choice import DtypeChoice


def test_auto_keeps_float32_for_stored_int4(monkeypatch):
    monkeypatch.setattr(builder, "choose_dtype", lambda *a: DtypeChoice("bfloat16", "this CPU has bf16"))
    auto = EngineConfig.from_flat(dtype="auto")
    assert builder.resolve_dtype(auto, None, keeps_int4=True).model.dtype == "float32"
    assert builder.resolve_dtype(auto, None, keeps_int4=False).model.dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_explicit_16_bit_dtype_with_stored_int4_is_refused(dtype):
    with pytest.raises(ConfigError, match="--quantization float") as e:
        builder.resolve_dtype(EngineConfig.from_flat(dtype=dtype), None, keeps_int4=True)
    assert e.value.param == "dtype"
    fp32 = EngineConfig.from_flat(dtype="float32")
    assert builder.resolve_dtype(fp32, None, keeps_int4=True).model.dtype == "float32"
