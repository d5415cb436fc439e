"""The CPU KV pool: zeros of the asked shape and dtype, writable, whose pages
are only taken (RSS) when written."""
import re
from pathlib import Path

import pytest
import torch

from kiln.llm.runner.kv_pool import kv_pool_tensor

CPU = torch.device("cpu")


def rss() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_pool_is_zeros_of_its_shape_and_dtype_and_writable(dtype):
    pool = kv_pool_tensor((2, 64, 3, 16), dtype, CPU)
    assert pool.shape == (2, 64, 3, 16) and pool.dtype == dtype and pool.is_contiguous()
    assert torch.count_nonzero(pool) == 0
    pool[1, 5] = 1.5
    assert pool[1, 5].float().sum().item() == 1.5 * 3 * 16 and pool.float().sum().item() == 1.5 * 3 * 16
    assert pool.data_ptr() % 4096 == 0  # page-aligned: any SIMD load width


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads VmRSS from /proc")
def test_pages_are_taken_only_when_written():
    before = rss()
    pool = kv_pool_tensor((2, 2**20, 4, 16), torch.float32, CPU)  # 512 MiB reserved
    assert rss() - before < 64 * 2**20
    pool[0, : 2**16] = 1.0  # 16 MiB written
    assert rss() - before >= 16 * 2**20
    del pool


def test_an_empty_pool():
    assert kv_pool_tensor((2, 0, 3, 16), torch.float32, CPU).numel() == 0
