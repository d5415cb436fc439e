"""The model dtype with a pre-quantized checkpoint's kept int4 projections: `auto`
takes the CPU's choice as for any model (bfloat16 with Kiln's avx512_bf16 kernels,
where those projections compute with their weights rounded to bf16 at every row
count: kiln/llm/quant/int4_cpu.py; float32 elsewhere); an explicit dtype is
honoured. (16-bit dtypes were once refused for a supposed prefix-cache defect that
was a near-tie flipped by 16-bit rounding: tests/integration/llm/test_numerics.py.)"""
import pytest

from kiln.config import EngineConfig
from kiln.llm.engine import builder
from kiln.llm.models.dtype_choice import DtypeChoice


@pytest.mark.parametrize("cpu_choice", ["bfloat16", "float32"])
def test_auto_takes_the_cpu_choice(monkeypatch, cpu_choice):
    monkeypatch.setattr(builder, "choose_dtype", lambda *a: DtypeChoice(cpu_choice, "this CPU's choice"))
    auto = EngineConfig.from_flat(dtype="auto")
    assert builder.resolve_dtype(auto, None).model.dtype == cpu_choice


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_is_honoured(dtype):
    config = EngineConfig.from_flat(dtype=dtype)
    assert builder.resolve_dtype(config, None).model.dtype == dtype


def test_auto_with_int8_activations_is_float32_even_where_the_cpu_picks_bf16(monkeypatch):
    """`--int4-activations int8` is linear_w4a8's fp32 path: `auto` must not pick a
    16-bit dtype the config then refuses (it did on AVX512_BF16 CPUs: a start-up error)."""
    monkeypatch.setattr(builder, "choose_dtype", lambda *a: DtypeChoice("bfloat16", "this CPU's choice"))
    config = EngineConfig.from_flat(dtype="auto", int4_activations="int8")
    assert builder.resolve_dtype(config, None).model.dtype == "float32"
    assert builder.dtype_for(config, None).reason.startswith("auto with --int4-activations int8")
