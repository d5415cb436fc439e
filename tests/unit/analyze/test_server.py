"""The analyzer's server: a configuration is measured once its memory has settled."""
from __future__ import annotations

from kiln.analyze import server as server_module
from kiln.analyze.server import ServerProcess


def test_memory_is_read_once_it_stops_growing(monkeypatch):
    # An LLM engine faults its KV pool in while idle after it starts: a level measured at once
    # read 1871 MiB where the same layout read 2849 MiB a configuration later.
    mib = 1 << 20
    readings = iter([600 * mib, 1400 * mib, 2200 * mib, 2840 * mib, 2849 * mib, 2849 * mib])
    seen = []
    process = object.__new__(ServerProcess)  # no subprocess: only the waiting is under test
    monkeypatch.setattr(ServerProcess, "resident_bytes", lambda self: seen.append(next(readings)) or seen[-1])
    monkeypatch.setattr(server_module, "SETTLE_POLL_S", 0.0)
    process.settle_memory()
    assert seen[-1] == 2849 * mib and len(seen) == 5
