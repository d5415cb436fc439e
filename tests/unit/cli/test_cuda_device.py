"""`--device cuda` where no GPU is visible: a ConfigError naming the device
from `kiln serve`, `kiln generate` and `LLM(device="cuda")`, exit code 2 from
the CLI and no traceback; raised before any model is loaded. And the fp8 KV
pool, a CUDA-only option, refused elsewhere."""
import subprocess
import sys

import pytest
import torch

from kiln.cli.main import main
from kiln.config import EngineConfig
from kiln.errors import ConfigError

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible here")


def test_kiln_serve_exits_2_with_the_reason():
    proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "serve", "--device", "cuda", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "kiln: error: device 'cuda' requested but" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_kiln_generate_exits_2_with_the_reason(capsys):
    assert main(["generate", "--device", "cuda:0", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "device 'cuda:0' requested but" in err and "--device cpu" in err


def test_llm_raises_a_config_error_naming_the_device():
    from kiln import LLM

    with pytest.raises(ConfigError, match="device 'cuda' requested") as info:
        LLM(device="cuda")
    assert info.value.param == "device"


def test_fp8_kv_cache_is_cuda_only(capsys):
    with pytest.raises(ConfigError, match="fp8_e4m3' needs --device cuda"):
        EngineConfig.from_flat(kv_cache_dtype="fp8_e4m3")
    assert EngineConfig.from_flat(kv_cache_dtype="fp8_e4m3", device="cuda").cache.kv_cache_dtype == "fp8_e4m3"
    assert main(["generate", "--kv-cache-dtype", "fp8_e4m3", "--prompt", "hi"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err


def test_cuda_graph_options_are_validated():
    assert EngineConfig.from_flat(enable_cuda_graphs=False).model.enable_cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graph_max_batch_size"):
        EngineConfig.from_flat(cuda_graph_max_batch_size=0)


def test_an_fp8_pool_without_the_triton_backend_is_a_config_error():
    from torch import nn

    from kiln.llm.attention.selector import install_attention_backend

    with pytest.raises(ConfigError, match="fp8_e4m3' needs Kiln's Triton kernels"):
        install_attention_backend(nn.Module(), torch.device("cpu"), torch.float8_e4m3fn)
