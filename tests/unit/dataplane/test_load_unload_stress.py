"""Concurrent load / unload / infer on one model (checklist item 26).

Loaders, unloaders and clients race on the same model for a while, in a
seeded random order. Whatever the interleaving: every inference either gets
the right answer or a typed "not available" error, no call hangs, every
loaded instance is unloaded exactly once, and the model ends in the state
the last control call asked for.
"""

from __future__ import annotations

import asyncio
import random
import textwrap

import numpy as np

from kiln.errors import ModelNotFoundError, ModelUnavailableError
from kiln.serving.types import InferRequest
from tests.unit.dataplane.planes import repository_plane
from tests.unit.serving.models import doubler_config, write_model

# Each instance writes "+<id>" when loaded and "-<id>" when unloaded, so the
# test can count what lived and what was released.
LEDGER_PY = textwrap.dedent('''
    import time, uuid

    class Doubler:
        def load(self, context):
            self.ledger = context.config.parameters["ledger"]
            self.id = uuid.uuid4().hex
            time.sleep(0.01)
            with open(self.ledger, "a") as f:
                f.write(f"+{self.id}\\n")

        def execute(self, requests):
            time.sleep(0.002)
            return [{"OUT": r.inputs["IN"] * 2} for r in requests]

        def unload(self):
            with open(self.ledger, "a") as f:
                f.write(f"-{self.id}\\n")
''')

SECONDS = 2.0


def test_loads_unloads_and_inferences_racing_leave_a_consistent_server(tmp_path):
    ledger = tmp_path / "ledger.txt"
    repository = tmp_path / "repository"
    write_model(repository, "doubler", doubler_config(parameters={"ledger": str(ledger)}), {1: {"model.py": LEDGER_PY}})
    rng = random.Random(26)
    outcomes = {"ok": 0, "unavailable": 0}

    async def client(plane, deadline):
        while asyncio.get_running_loop().time() < deadline:
            value = rng.choice([1.0, 2.5, 7.0])
            try:
                response = await plane.infer(InferRequest("doubler", {"IN": np.full((1, 2), value, np.float32)}))
            except (ModelUnavailableError, ModelNotFoundError):
                outcomes["unavailable"] += 1
            else:
                assert response.outputs["OUT"].tolist() == [[2 * value, 2 * value]]
                outcomes["ok"] += 1
            await asyncio.sleep(rng.uniform(0, 0.004))

    async def controller(plane, deadline, action):
        while asyncio.get_running_loop().time() < deadline:
            await (plane.load_model("doubler") if action == "load" else plane.unload_model("doubler"))
            await asyncio.sleep(rng.uniform(0, 0.02))

    async def main():
        plane = repository_plane(repository)
        await plane.start()
        deadline = asyncio.get_running_loop().time() + SECONDS
        racers = [client(plane, deadline) for _ in range(8)]
        racers += [controller(plane, deadline, action) for action in ("load", "unload", "load", "unload")]
        await asyncio.wait_for(asyncio.gather(*racers), timeout=60)
        await asyncio.wait_for(plane.load_model("doubler"), timeout=10)
        ready_after_load = plane.model_ready("doubler")
        answer = await plane.infer(InferRequest("doubler", {"IN": np.ones((1, 2), np.float32)}))
        await asyncio.wait_for(plane.unload_model("doubler"), timeout=10)
        ready_after_unload = plane.model_ready("doubler")
        await asyncio.wait_for(plane.shutdown(), timeout=10)
        return ready_after_load, answer, ready_after_unload

    ready_after_load, answer, ready_after_unload = asyncio.run(main())
    assert ready_after_load and answer.outputs["OUT"].tolist() == [[2.0, 2.0]]
    assert not ready_after_unload
    assert outcomes["ok"] > 0 and outcomes["unavailable"] > 0, outcomes  # the race really happened
    lines = ledger.read_text().split()
    loaded = [line[1:] for line in lines if line.startswith("+")]
    unloaded = [line[1:] for line in lines if line.startswith("-")]
    assert len(loaded) > 2 and len(set(loaded)) == len(loaded)
    assert sorted(unloaded) == sorted(loaded), "an instance leaked or was unloaded twice"
