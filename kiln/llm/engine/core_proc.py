"""The engine-core process: `python -m kiln.llm.engine.core_proc`, started by
the API process (core_client.ProcessEngineClient); only that process imports
this module.

The wire is two one-way OS pipes carrying length-prefixed msgpack frames
(`multiprocessing.connection.Connection.send_bytes` / `recv_bytes`; never
`send` / `recv`, which pickle) of the types in `messages`. The engine's
config is the first frame. The engine exits when told to, when its inbox pipe
closes, or when its parent process is gone (polled by a watchdog thread), so
it never outlives the server.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from multiprocessing.connection import Connection

import msgspec
import torch

from kiln.config import EngineConfig
from kiln.errors import ConfigError, KilnError, ModelLoadError
from kiln.llm.engine.builder import build_engine_core
from kiln.llm.engine.loop import EngineLoop, Inbox, ready_message
from kiln.llm.engine.messages import Failed, FromEngine, ToEngine, encoder, to_engine_decoder
from kiln.llm.parent_watch import watch_parent

log = logging.getLogger(__name__)


def pick_torch_threads() -> int:
    """One intra-op thread per core this process may run on: the engine step is
    the hot path, the API process needs little CPU. OMP_NUM_THREADS wins (on a
    busy shared machine fewer threads can be faster). See docs/benchmarks.md
    (Serving, side by side with `vllm serve`)."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def pipe_inbox(conn: Connection) -> Inbox:
    def inbox(timeout: float) -> list[ToEngine]:
        messages = []
        wait = timeout
        while conn.poll(wait):
            messages.append(to_engine_decoder.decode(conn.recv_bytes()))
            wait = 0.0
        return messages

    return inbox


def serve_engine(inbox_conn: Connection, outbox_conn: Connection) -> int:
    """Body of the engine process: config in, Ready out, then the loop."""
    def send(msg: FromEngine) -> None:
        outbox_conn.send_bytes(encoder.encode(msg))

    core = None
    try:
        config = msgspec.msgpack.decode(inbox_conn.recv_bytes(), type=EngineConfig)
        core, checkpoint = build_engine_core(config)
        send(ready_message(core, checkpoint))
        EngineLoop(core, pipe_inbox(inbox_conn), send, lambda: True).run()
        return 0
    except (EOFError, BrokenPipeError):
        return 0  # the API process closed its end: nothing left to do
    except BaseException as e:
        if isinstance(e, KilnError):  # a user's error (a config, a model): its message says it all
            log.error("engine failed: %s", e)
        else:
            log.exception("engine failed")
        with contextlib.suppress(OSError):
            send(Failed(f"{type(e).__name__}: {e}", unusable_model=isinstance(e, ConfigError | ModelLoadError)))
        return 1
    finally:
        if core is not None:
            core.shutdown()  # stops (or, after a failure, kills) parallel workers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kiln engine-core process (started by the server).")
    parser.add_argument("--inbox-fd", type=int, required=True)
    parser.add_argument("--outbox-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    # The parent coordinates shutdown (drain first); signals to the whole
    # process group must not kill the engine under in-flight requests.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=os.environ.get("KILN_LOG_LEVEL", "INFO"), format="%(asctime)s engine %(levelname)s %(message)s"
    )
    watch_parent(args.parent_pid)
    log.info("engine process %d: %d torch threads", os.getpid(), pick_torch_threads())
    inbox = Connection(args.inbox_fd, readable=True, writable=False)
    outbox = Connection(args.outbox_fd, readable=False, writable=True)
    return serve_engine(inbox, outbox)


if __name__ == "__main__":
    sys.exit(main())
