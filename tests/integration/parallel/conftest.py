"""Shared pieces of the parallel tests: tiny models, prompts, process checks."""
from __future__ import annotations

import random
import time

import psutil
import pytest

from tests.conftest import build_tiny_llama

NUM_PROMPTS = 8


@pytest.fixture(scope="session")
def tiny_kv1_dir(tmp_path_factory, smollm2_tokenizer):
    """One KV head (replicated on every TP rank), tied embeddings, 3 layers
    (an uneven pipeline split)."""
    directory = tmp_path_factory.mktemp("tiny_kv1")
    return build_tiny_llama(
        directory, smollm2_tokenizer, num_key_value_heads=1, num_hidden_layers=3, tie_word_embeddings=True
    )


@pytest.fixture(scope="session")
def token_prompts() -> list[list[int]]:
    """Eight prompts of 3..60 random token ids (one continuous batch)."""
    rng = random.Random(0)
    return [[rng.randrange(3, 49152) for _ in range(rng.randrange(3, 60))] for _ in range(NUM_PROMPTS)]


def worker_processes() -> list[psutil.Process]:
    """Parallel worker processes descended from this test process."""
    found = []
    for child in psutil.Process().children(recursive=True):
        try:
            if "kiln.llm.parallel.worker" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            pass
    return found


def wait_no_workers(timeout_s: float = 15.0) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in worker_processes() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


@pytest.fixture(autouse=True)
def no_leaked_workers():
    """Every test must leave no worker process behind (also when it fails)."""
    yield
    leaked = wait_no_workers()
    for p in leaked:
        p.kill()
    assert not leaked, f"leaked worker processes: {[p.pid for p in leaked]}"
