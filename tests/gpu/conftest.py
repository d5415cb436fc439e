"""GPU tests: marked `gpu`, skipped where no CUDA device is visible.

Run them on a CUDA machine with `pytest tests/gpu` (bench/device_check.sh
does, then benchmarks). Kernels run compiled here (never the interpreter),
bf16 `tl.dot` on the tensor cores included.
"""
import pytest
import torch

TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=8, num_kv_heads=2,
            head_dim=32, rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=1024, tie_word_embeddings=False)


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "tests/gpu/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def compiled_kernels(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def tiny_arch():
    from kiln.llm.models.arch import LlamaArch

    return LlamaArch(**TINY)
