"""The engine process on its own: start-up failures, exit on parent death, a
request its wire cannot carry, and an engine started ahead of its client
(`kiln serve` overlaps the engine's start with the API's imports)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kiln.config import EngineConfig, flat_options
from kiln.errors import InvalidRequestError, ModelLoadError
from kiln.llm.engine import core_client
from kiln.llm.engine.async_llm import AsyncLLM
from kiln.llm.engine.core_client import ProcessEngineClient, discard_prespawned, prespawn
from kiln.llm.sampling_params import SamplingParams
from tests.integration.openai.live import ROOT


def test_a_bad_model_fails_the_start_with_the_reason(tmp_path):
    client = ProcessEngineClient(EngineConfig.from_flat(model=str(tmp_path / "missing.gguf")))
    started = time.monotonic()
    with pytest.raises(ModelLoadError) as e:  # the model's fault keeps its kind across the process boundary
        client.start(lambda r: None, lambda m: None)
    assert "missing.gguf" in e.value.message and time.monotonic() - started < 60
    assert client.proc.poll() is not None


def test_an_engine_started_ahead_is_adopted_by_the_first_client_of_its_config(tmp_path):
    config = EngineConfig.from_flat(model=str(tmp_path / "missing.gguf"), num_blocks=16, max_num_seqs=4)
    assert EngineConfig.from_flat(**flat_options(config)) == config  # what kiln serve prespawns is what it serves
    prespawn(config)
    ahead = core_client._ahead[config][0]
    client = ProcessEngineClient(config)
    with pytest.raises(ModelLoadError, match="missing.gguf"):
        client.start(lambda r: None, lambda m: None)
    assert client.proc is ahead and ahead.poll() is not None and not core_client._ahead
    assert discard_prespawned() == 0


def test_an_engine_started_ahead_and_not_adopted_is_stopped(tmp_path):
    prespawn(EngineConfig.from_flat(model=str(tmp_path / "missing.gguf"), num_blocks=16))
    ahead = next(iter(core_client._ahead.values()))[0]
    assert discard_prespawned() == 1
    assert ahead.poll() is not None and not core_client._ahead


def test_the_engine_exits_when_its_parent_is_killed(tiny_llama_dir):
    parent_code = textwrap.dedent(f"""
        import time
        from kiln.config import EngineConfig
        from kiln.llm.engine.core_client import ProcessEngineClient
        client = ProcessEngineClient(EngineConfig.from_flat(model={str(tiny_llama_dir)!r}, num_blocks=16))
        client.start(lambda r: None, lambda m: None)
        print(client.proc.pid, flush=True)
        time.sleep(600)
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
    try:
        engine = psutil.Process(int(parent.stdout.readline()))
        assert engine.is_running()
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        engine.wait(timeout=10)  # psutil.TimeoutExpired if it outlives its parent
    finally:
        parent.kill()


def test_kiln_serve_exits_nonzero_when_the_model_cannot_load(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "serve", str(tmp_path / "nope.gguf"), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2  # refused before the server starts, like any bad argument
    assert "nope.gguf" in proc.stderr and "does not exist" in proc.stderr


def test_a_request_the_wire_cannot_carry_fails_alone_and_the_next_is_served(tiny_llama_dir):
    """Such a request once killed the writer thread, and every later request hung (issue 17)."""
    def poisoned(**change) -> SamplingParams:
        params = SamplingParams(max_tokens=2, temperature=1.0, seed=1)
        for name, value in change.items():  # as if it had slipped past validation
            setattr(params, name, value)
        return params

    async def main():
        engine = await AsyncLLM.start(EngineConfig.from_flat(model=str(tiny_llama_dir), num_blocks=16), "process")
        try:
            for i, change in enumerate(({"seed": 2**64}, {"stop": ["\ud800"]})):
                with pytest.raises(InvalidRequestError, match="cannot be sent to the engine"):
                    engine.add_request(f"bad{i}", "Hi", poisoned(**change))
            assert engine.num_in_flight == 0
            greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            outs = [out async for out in engine.generate("Hello", greedy, "good")]
            return outs[-1].outputs[0].token_ids, engine.client.engine_pid, engine.is_dead
        finally:
            await engine.shutdown()

    token_ids, pid, dead = asyncio.run(asyncio.wait_for(main(), 120))
    assert len(token_ids) == 3 and pid is not None and not dead
