"""The multi-machine path on loopback: two processes started by hand with the
torchrun-style environment (MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) form
one TP=2 engine, and its greedy text equals a single process's."""
from __future__ import annotations

import os
import subprocess
import sys

from kiln import LLM, SamplingParams
from tests.integration.openai.live import ROOT, free_port

PROMPT = "The capital of France is"


def kiln(*args: str, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kiln.cli.main", *args]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def test_two_processes_from_env_match_one(tiny_llama_dir):
    # What `kiln generate` prints, one process (fp32: the parallel run must match it).
    with LLM(str(tiny_llama_dir), num_blocks=64, dtype="float32") as llm:
        expected = llm.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0].text + "\n"
    base = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "KILN_LOG_LEVEL": "WARNING"}
    gen = [
        "generate", str(tiny_llama_dir), "--prompt", PROMPT, "--max-tokens", "12", "--num-blocks", "64",
        "--dtype", "float32",
    ]

    dist_env = {**base, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    driver = kiln(*gen, "--tensor-parallel-size", "2", "--worker-launch", "env", env={**dist_env, "RANK": "0"})
    worker = kiln("worker", env={**dist_env, "RANK": "1"})
    try:
        code, out, err = finish(driver, 120)
        assert code == 0, err
        assert out == expected
        wcode, _, werr = finish(worker, 30)
        assert wcode == 0, werr  # told to stop by the driver, not orphaned
    finally:
        for p in (driver, worker):
            if p.poll() is None:
                p.kill()
                p.wait()
