"""Idle-time warming of the CPU KV pool: which pieces, in what order, that
they end up resident with their contents kept, and that the engine loop
warms only while idle and blocks on its inbox again once the pool is in."""
import re
from pathlib import Path

import pytest
import torch

from kiln.config import EngineConfig
from kiln.llm.engine.core import EngineCore
from kiln.llm.engine.loop import IDLE_POLL_S, EngineLoop
from kiln.llm.engine.messages import AddRequest, EngineCoreRequest, Shutdown
from kiln.llm.runner.kv_pool import kv_pool_tensor
from kiln.llm.runner.kv_warm import PAGE_BYTES, KvPoolWarmer, pool_pieces
from kiln.llm.sampling_params import SamplingParams
from tests.unit.llm.engine.fakes import ScriptedRunner, as_runner

CPU = torch.device("cpu")
LINUX_PROC = Path("/proc/self/status").exists()


def rss() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def test_pieces_cover_every_half_in_block_order_on_page_boundaries():
    # 2 x 5 slots x 3 heads x 64 dims of bf16: halves of 1,920 bytes, so the
    # value half starts mid-page and is rounded down to its page.
    pools = [kv_pool_tensor((2, 5, 3, 64), torch.bfloat16, CPU) for _ in range(2)]
    half = 5 * 3 * 64 * 2
    pieces = list(pool_pieces(pools, piece_bytes=1024))
    bases = [p.data_ptr() for p in pools]
    starts = [bases[0], bases[0] + half, bases[1], bases[1] + half]
    # Band by band (first 1 KiB of each of the four halves, then the rest of each).
    expected = [(s + off, min(1024, half - off)) for off in (0, 1024) for s in starts]
    got = [(addr, length) for addr, length in pieces]
    assert len(got) == len(expected)
    for (addr, length), (start, want) in zip(got, expected, strict=True):
        assert addr % PAGE_BYTES == 0 and addr <= start < addr + PAGE_BYTES
        assert addr + length == start + want  # ends exactly where the piece ends


def test_no_pools_and_empty_pools_have_nothing_to_warm():
    assert list(pool_pieces([])) == []
    warmer = KvPoolWarmer([kv_pool_tensor((2, 0, 3, 16), torch.float32, CPU)])
    assert warmer.step() is False and warmer.done


@pytest.mark.skipif(not LINUX_PROC, reason="MADV_POPULATE_WRITE and VmRSS are Linux's")
def test_a_warmed_pool_is_resident_and_keeps_what_was_written():
    pools = [kv_pool_tensor((2, 2**18, 2, 16), torch.float32, CPU) for _ in range(2)]  # 4 x 32 MiB halves
    pools[0][0, 7] = 1.5
    pools[1][1, 2**18 - 1] = -2.0
    before = rss()
    warmer = KvPoolWarmer(pools)
    steps = 0
    while warmer.step():
        steps += 1
    if steps == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert steps == 4 * 16  # 32 MiB halves in 2 MiB pieces
    assert rss() - before >= 4 * 30 * 2**20
    assert pools[0][0, 7].eq(1.5).all() and pools[1][1, 2**18 - 1].eq(-2.0).all()
    assert torch.count_nonzero(pools[0]) == 2 * 16 and torch.count_nonzero(pools[1]) == 2 * 16
    assert warmer.step() is False  # done stays done


class WarmingRunner(ScriptedRunner):
    def __init__(self, pieces: int):
        super().__init__({"r": [5, 6]})
        self.pieces = pieces
        self.warmed_after_steps: list[int] = []  # how many steps had run at each piece

    def warm_kv_pool(self) -> bool:
        if self.pieces == 0:
            return False
        self.pieces -= 1
        self.warmed_after_steps.append(len(self.steps))
        return True


def run_loop(runner: WarmingRunner, inbox_script: list[list], **flat) -> list[float]:
    """Runs an EngineLoop whose inbox hands out `inbox_script` one call at a
    time (Shutdown when it runs out); returns the timeouts it was asked for."""
    config = EngineConfig.from_flat(num_blocks=16, block_size=4, **flat)
    core = EngineCore(config, as_runner(runner), 16, max_model_len=64)
    timeouts: list[float] = []

    def inbox(timeout: float) -> list:
        timeouts.append(timeout)
        return inbox_script.pop(0) if inbox_script else [Shutdown()]

    EngineLoop(core, inbox, lambda result: None, lambda: True).run()
    return timeouts


def test_the_loop_warms_while_idle_and_blocks_once_the_pool_is_in():
    runner = WarmingRunner(pieces=3)
    timeouts = run_loop(runner, [[], [], [], []])
    assert timeouts == [0.0, 0.0, 0.0, IDLE_POLL_S, IDLE_POLL_S] and runner.pieces == 0


def test_the_loop_does_not_warm_while_a_request_runs():
    runner = WarmingRunner(pieces=100)
    add = AddRequest(EngineCoreRequest("r", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0.0)))
    timeouts = run_loop(runner, [[add], [], []])
    # A piece before the request arrives, none between its two steps, then pieces again.
    assert runner.warmed_after_steps == [0, 2, 2] and len(runner.steps) == 2
    assert timeouts == [0.0, 0.0, 0.0, 0.0]


def test_warming_off_blocks_on_the_inbox_at_once():
    runner = WarmingRunner(pieces=3)
    assert run_loop(runner, [[]], warm_kv_pool=False) == [IDLE_POLL_S, IDLE_POLL_S] and runner.pieces == 3


@pytest.mark.skipif(not LINUX_PROC, reason="MADV_POPULATE_WRITE is Linux's")
def test_threads_warming_at_once_take_each_piece_once():
    from concurrent.futures import ThreadPoolExecutor

    pools = [kv_pool_tensor((2, 2**16, 2, 16), torch.float32, CPU) for _ in range(2)]  # 4 x 8 MiB halves
    warmer = KvPoolWarmer(pools)

    def drain(_: int) -> int:
        steps = 0
        while warmer.step():
            steps += 1
        return steps

    with ThreadPoolExecutor(4) as pool:
        counts = list(pool.map(drain, range(4)))
    if sum(counts) == 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14)")
    assert sum(counts) == 4 * 4 and warmer.done  # 8 MiB halves in 2 MiB pieces, none taken twice
