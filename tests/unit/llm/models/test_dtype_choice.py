"""`--dtype auto` (the default): bfloat16 on CPUs with AVX512_BF16 or AMX and
Kiln's bf16 kernel build loaded, float32 on other CPUs (also when KILN_ISA
forces a lower level), the checkpoint's dtype on CUDA; an explicit dtype
always wins. The engine builds its model in the chosen dtype and reports it."""
import pytest
import torch

from kiln.config import EngineConfig
from kiln.llm.engine.loop import ready_message
from kiln.llm.engine.synthetic import synthetic_engine_core
from kiln.llm.kernels import isa, ops
from kiln.llm.models.arch import LlamaArch
from kiln.llm.models.checkpoint import Checkpoint
from kiln.llm.models.dtype_choice import checkpoint_dtype, choose_dtype, cpu_auto

ZEN4 = isa.LEVEL_FLAGS["avx2"] | isa.LEVEL_FLAGS["avx512"] | isa.LEVEL_FLAGS["avx512_bf16"]
ARCH = LlamaArch(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=256,
                 tie_word_embeddings=True)


def level(name: str) -> isa.IsaChoice:
    return isa.IsaChoice("amx", name, name != "amx", ZEN4)


@pytest.mark.parametrize(
    "name,library,dtype",
    [("none", None, "float32"), ("avx2", "avx2", "float32"), ("avx512", "avx2", "float32"),
     ("avx512_bf16", "avx512_bf16", "bfloat16"), ("amx", "avx512_bf16", "bfloat16"),
     ("avx512_bf16", "avx2", "float32"), ("amx", None, "float32")],  # bf16 CPU, but its kernels not loaded
)
def test_auto_on_cpu_is_bf16_only_with_bf16_dot_products_and_their_kernels(name, library, dtype):
    choice = cpu_auto(level(name), library)
    assert choice.dtype == dtype
    assert name in choice.reason


def test_an_explicit_dtype_is_honoured_on_any_cpu_and_device(monkeypatch):
    monkeypatch.setattr(isa, "cpu_isa", lambda: level("avx2"))
    for dtype in ("float32", "bfloat16", "float16"):
        assert choose_dtype(dtype, "cpu", None).dtype == dtype
        assert choose_dtype(dtype, "cuda", torch.float32).dtype == dtype
        assert choose_dtype(dtype, "cpu", None).reason == "set by --dtype"


def test_auto_on_cuda_is_the_checkpoints_dtype():
    assert choose_dtype("auto", "cuda", torch.bfloat16).dtype == "bfloat16"
    assert choose_dtype("auto", "cuda:1", torch.float16).dtype == "float16"
    assert choose_dtype("auto", "cuda", torch.float32).dtype == "float32"  # GGUF: dequantized to fp32
    assert choose_dtype("auto", "cuda", None).dtype == "float32"  # not known (weights not read here)
    assert checkpoint_dtype({"model.embed_tokens.weight": torch.zeros(2, 2, dtype=torch.bfloat16)}) == torch.bfloat16
    assert checkpoint_dtype({}) is None


@pytest.fixture
def forced_isa(monkeypatch):
    """Set KILN_ISA for this test (cpu_isa decides once per process: its cache is reset around it)."""
    def force(name: str) -> None:
        monkeypatch.setenv(isa.ENV_VAR, name)
        isa.cpu_isa.cache_clear()

    yield force
    monkeypatch.delenv(isa.ENV_VAR, raising=False)
    isa.cpu_isa.cache_clear()


def test_forced_avx2_makes_auto_float32_on_any_machine(forced_isa):
    forced_isa("avx2")
    assert choose_dtype("auto", "cpu", None).dtype == "float32"
    assert choose_dtype("bfloat16", "cpu", None).dtype == "bfloat16"


def test_the_engine_builds_and_reports_the_chosen_dtype(forced_isa):
    config = EngineConfig.from_flat(max_model_len=64, num_blocks=8)
    assert config.model.dtype == "auto"  # the default
    if isa.cpu_isa().detected != "none":  # (a CPU without AVX2 is float32 without forcing)
        forced_isa("avx2")
    core = synthetic_engine_core(ARCH, config)
    assert core.config.model.dtype == "float32"
    assert core.runner.model.embed_tokens.dtype == torch.float32
    checkpoint = Checkpoint(ARCH, {}, "tokenizer", "synthetic")
    assert ready_message(core, checkpoint).dtype == "float32"
    explicit = synthetic_engine_core(ARCH, EngineConfig.from_flat(max_model_len=64, num_blocks=8, dtype="bfloat16"))
    assert explicit.runner.model.embed_tokens.dtype == torch.bfloat16
    assert ready_message(explicit, checkpoint).dtype == "bfloat16"


@pytest.mark.skipif(not (isa.cpu_isa().at_least("avx512_bf16") and ops.loaded_library() == "avx512_bf16"),
                    reason="this CPU (or KILN_ISA) has no AVX512_BF16, or the avx512_bf16 build is not loaded")
def test_auto_runs_bf16_on_this_bf16_cpu():
    core = synthetic_engine_core(ARCH, EngineConfig.from_flat(max_model_len=64, num_blocks=8))
    assert core.config.model.dtype == "bfloat16"
    assert core.runner.model.embed_tokens.dtype == torch.bfloat16
    assert core.runner.model.fused_layers is not None  # the bf16 fused decode layer applies
