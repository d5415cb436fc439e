"""The engine process on its own: start-up failures, and exit on parent death."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from kiln.config import EngineConfig
from kiln.errors import EngineDeadError
from kiln.llm.engine.core_client import ProcessEngineClient
from tests.integration.openai.live import ROOT


def test_a_bad_model_fails_the_start_with_the_reason(tmp_path):
    client = ProcessEngineClient(EngineConfig.from_flat(model=str(tmp_path / "missing.gguf")))
    started = time.monotonic()
    with pytest.raises(EngineDeadError) as e:
        client.start(lambda r: None, lambda m: None)
    assert "missing.gguf" in e.value.message and time.monotonic() - started < 60
    assert client.proc.poll() is not None


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
    assert proc.returncode == 1
    assert "nope.gguf" in proc.stderr
