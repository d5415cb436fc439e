"""What an engine reports of its memory when ready: weights in the serving
layout, the packed prefill copies and the KV pool, exactly (a tied tensor
once), and the activation peak the builder measured (0: not measured);
nothing for a parallel runner."""

from types import SimpleNamespace

import torch
from torch import nn

from kiln.llm.engine.loop import memory_bytes


def test_single_process_runner_reports_weights_packed_copies_and_kv_pool():
    model = nn.Sequential(nn.Linear(8, 4, bias=False), nn.LayerNorm(4))  # 32 + 4 + 4 floats
    model.register_buffer("table", torch.zeros(10, dtype=torch.float16))  # 20 bytes
    model.register_buffer("tied", model[0].weight, persistent=False)  # the same tensor: counted once
    model[0].packed = torch.zeros(32)  # a prefill copy: 128 bytes
    model.lm_head_packed = torch.zeros(8, dtype=torch.bfloat16)  # the LM head's: 16 bytes
    runner = SimpleNamespace(model=model, kv_caches=[torch.zeros(2, 16, 2, 4) for _ in range(3)])
    expected = {
        "weights_bytes": 40 * 4 + 20, "packed_bytes": 128 + 16, "kv_cache_bytes": 3 * 2 * 16 * 2 * 4 * 4,
        "activations_peak_bytes": 0,
    }
    assert memory_bytes(runner) == expected
    runner.activations_peak_bytes = 5 << 20
    assert memory_bytes(runner) == {**expected, "activations_peak_bytes": 5 << 20}


def test_parallel_runner_reports_nothing():
    assert memory_bytes(SimpleNamespace(model=nn.Linear(2, 2))) == {}  # its ranks hold shards; no kv_caches here
