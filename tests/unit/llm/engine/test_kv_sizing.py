"""The KV pool's size: the configured GiB, else a fraction of the memory
available (read from /proc/meminfo and the cgroup), as exact block counts."""
from types import SimpleNamespace

import pytest
import torch

from kiln.config import CacheConfig, EngineConfig
from kiln.errors import ConfigError
from kiln.llm.engine import kv_sizing
from kiln.llm.engine.builder import decide_num_blocks

GIB = 2**30
CPU = torch.device("cpu")
# 2 layers x (k, v) x 16 tokens x 2 kv heads x 8 dims x 4 bytes (fp32) = 4096 bytes per block
MODEL = SimpleNamespace(arch=SimpleNamespace(num_layers=2, num_kv_heads=2, head_dim=8))


def reader(free: int | None):
    return lambda device: free


def test_the_default_pool_is_a_tenth_of_available_memory():
    config = EngineConfig.from_flat(dtype="float32")
    assert config.cache.kv_cache_memory_gib is None and config.cache.kv_cache_memory_fraction == 0.1
    assert decide_num_blocks(MODEL, config, 128, reader(10 * GIB)) == (GIB // 4096)
    assert decide_num_blocks(MODEL, config, 128, reader(8192 * 10 + 4095 * 10)) == 2  # 12287 bytes: 2 blocks


def test_the_fraction_and_the_gib_and_num_blocks_override_in_that_order():
    half = EngineConfig.from_flat(dtype="float32", kv_cache_memory_fraction=0.5)
    assert decide_num_blocks(MODEL, half, 128, reader(40960)) == 5
    fixed = EngineConfig.from_flat(dtype="float32", kv_cache_memory_fraction=0.5, kv_cache_memory_gib=0.25)
    assert decide_num_blocks(MODEL, fixed, 128, reader(10 * GIB)) == GIB // 4 // 4096  # not a fraction of it
    blocks = EngineConfig.from_flat(dtype="float32", kv_cache_memory_gib=0.25, num_blocks=7)
    assert decide_num_blocks(MODEL, blocks, 128, reader(40960)) == 7


@pytest.mark.parametrize("options", [dict(kv_cache_memory_gib=100), dict(num_blocks=30 * GIB // 4096)])
def test_a_pool_sized_by_hand_must_fit_the_memory_there_is(options):
    # A 100 GiB pool loaded on a 23 GiB machine; faulting it in then got the process killed.
    config = EngineConfig.from_flat(dtype="float32", **options)
    with pytest.raises(ConfigError, match=r"does not fit the 23.00 GiB of memory available on cpu") as e:
        decide_num_blocks(MODEL, config, 128, reader(23 * GIB))
    assert e.value.param == "kv_cache_memory_gib"
    assert decide_num_blocks(MODEL, config, 128, reader(None)) > 0  # memory unknown: as asked


def test_a_16_bit_pool_fits_twice_the_blocks():
    config = EngineConfig.from_flat(dtype="float32", kv_cache_dtype="bfloat16")
    assert decide_num_blocks(MODEL, config, 128, reader(10 * 4096 * 10)) == 20


def test_too_little_memory_still_gives_one_block_and_unknown_memory_counts_as_4_gib(caplog):
    config = EngineConfig.from_flat(dtype="float32")
    assert decide_num_blocks(MODEL, config, 128, reader(100)) == 1
    assert kv_sizing.kv_pool_bytes(config.cache, CPU, reader(None)) == int(4 * GIB * 0.1)
    assert "available memory unknown" in caplog.text


@pytest.mark.parametrize("fraction", [0.0, -0.1, 0.95, 1.0])
def test_fractions_outside_the_range_are_refused(fraction):
    with pytest.raises(ConfigError, match="kv_cache_memory_fraction must be in"):
        CacheConfig(kv_cache_memory_fraction=fraction)


def test_meminfo_and_the_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n")
    assert kv_sizing.meminfo_available(meminfo) == 12000000 * 1024
    assert kv_sizing.meminfo_available(tmp_path / "absent") is None
    root = tmp_path / "cgroup"
    group = root / "kiln.slice"
    group.mkdir(parents=True)
    membership = tmp_path / "self-cgroup"
    membership.write_text("0::/kiln.slice\n")
    (group / "memory.max").write_text("max\n")
    (group / "memory.current").write_text("1000\n")
    assert kv_sizing.cgroup_headroom(root, membership) is None  # no limit
    (group / "memory.max").write_text("5000\n")
    assert kv_sizing.cgroup_headroom(root, membership) == 4000
    (group / "memory.current").write_text("6000\n")
    assert kv_sizing.cgroup_headroom(root, membership) == 0
    assert kv_sizing.cgroup_headroom(tmp_path / "no-cgroupfs", membership) is None


def test_the_real_reader_gives_a_positive_figure_on_linux():
    free = kv_sizing.available_memory_bytes(CPU)
    assert free is None or free > 0


def test_a_context_length_asked_for_must_fit_the_pool_and_the_models_own_is_lowered(caplog):
    from kiln.llm.engine.builder import fit_context
    asked = EngineConfig.from_flat(dtype="float32", max_model_len=400, num_blocks=4, block_size=4)
    with pytest.raises(ConfigError, match="max_model_len 400 needs 400 tokens of KV cache, but the pool holds 16"):
        fit_context(asked, 400, 4)  # was lowered to 16 in silence
    own = EngineConfig.from_flat(dtype="float32", num_blocks=4, block_size=4)
    with caplog.at_level("WARNING"):
        assert fit_context(own, 2048, 4) == 16
    assert "max_model_len lowered from 2048 to 16" in caplog.text
    assert fit_context(asked, 16, 4) == 16
