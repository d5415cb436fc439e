"""The tiny float Llama every format test quantizes."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM


@pytest.fixture(scope="module")
def float_model(tiny_llama_dir) -> LlamaForCausalLM:
    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
