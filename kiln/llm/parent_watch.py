"""Child processes (the engine core, spawned parallel workers) end with their parent."""
from __future__ import annotations

import os
import threading
import time


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> None:
    """Exit this process as soon as `parent_pid` is no longer our parent."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(1)  # the parent is gone: no one can read our outputs

    threading.Thread(target=watch, name="kiln-parent-watch", daemon=True).start()
