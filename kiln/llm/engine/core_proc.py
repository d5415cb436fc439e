"""The engine-core busy loop, and the process that runs it.

    API process                               engine process
    ───────────                               ──────────────
    core_client ── AddRequest / Abort / ──►   EngineLoop: drain inbox,
                   Shutdown (msgpack)         core.step(), send StepResult
                ◄── Ready / StepResult / ──
                    Failed (msgpack)

The wire is two one-way OS pipes carrying length-prefixed msgpack frames
(`multiprocessing.connection.Connection.send_bytes` / `recv_bytes`; never
`send` / `recv`, which pickle). The engine's config is the first frame.
The engine exits when told to, when its inbox pipe closes, or when its parent
process is gone (polled by a watchdog thread), so it never outlives the server.

`EngineLoop` knows nothing of pipes: the in-process mode (`core_client`)
runs the same loop in a thread with a queue for an inbox.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from kiln.config import EngineConfig
from kiln.llm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from kiln.llm.parent_watch import watch_parent

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.5  # how long an idle engine blocks on its inbox before re-checking its parent


# ---- the protocol ------------------------------------------------------------


class AddRequest(msgspec.Struct, tag="add"):
    request: EngineCoreRequest


class Abort(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class Ready(msgspec.Struct, tag="ready"):
    """The engine has loaded its model; what the API side needs to know of it."""

    max_model_len: int
    vocab_size: int
    tokenizer_path: str
    source: str
    num_blocks: int
    block_size: int
    pid: int
    worker_pids: list[int] = []  # tensor/pipeline-parallel worker processes this engine spawned


class StepResult(msgspec.Struct, tag="step"):
    outputs: EngineCoreOutputs
    # Requests first scheduled in this step -> seconds they waited since arrival.
    queue_times: dict[str, float] = {}


class Failed(msgspec.Struct, tag="failed"):
    message: str


ToEngine = AddRequest | Abort | Shutdown
FromEngine = Ready | StepResult | Failed

to_engine_decoder = msgspec.msgpack.Decoder(ToEngine)
from_engine_decoder = msgspec.msgpack.Decoder(FromEngine)
encoder = msgspec.msgpack.Encoder()


# ---- the loop ----------------------------------------------------------------

# Returns the next inbox messages: waits up to `timeout` seconds for the first
# (0 = do not wait), then takes whatever else is already there.
Inbox = Callable[[float], list[ToEngine]]


class EngineLoop:
    """Drain the inbox, step the core while it has work, report every step.

    Invariant: every request the core holds has arrived through the inbox, and
    each `step()` result is sent before the next inbox drain, so an abort takes
    effect (and frees its KV blocks) at the next step boundary.
    """

    def __init__(self, core, inbox: Inbox, send: Callable[[FromEngine], None], alive: Callable[[], bool]):
        self.core = core
        self.inbox = inbox
        self.send = send
        self.alive = alive
        self.unscheduled: dict[str, float] = {}  # request id -> arrival (monotonic)
        self.stopped = False

    def run(self) -> None:
        while not self.stopped and self.alive():
            self.core.check_health()  # a dead parallel worker ends the loop with EngineDeadError
            busy = self.core.has_unfinished()
            aborted = self.handle(self.inbox(0.0 if busy else IDLE_POLL_S))
            if self.stopped:
                break
            if self.core.has_unfinished():
                self.step()
            elif aborted:
                # No step follows, so report the freed blocks now.
                self.send(StepResult(EngineCoreOutputs([], self.core.stats())))

    def handle(self, messages: list[ToEngine]) -> bool:
        """Apply inbox messages; True if any abort was applied."""
        aborted = False
        for msg in messages:
            if isinstance(msg, AddRequest):
                self.core.add_request(msg.request)
                self.unscheduled[msg.request.request_id] = msg.request.arrival_time or time.monotonic()
            elif isinstance(msg, Abort):
                self.core.abort_requests(msg.request_ids)
                for rid in msg.request_ids:
                    self.unscheduled.pop(rid, None)
                aborted = True
            elif isinstance(msg, Shutdown):
                self.stopped = True
        return aborted

    def step(self) -> None:
        started = time.monotonic()
        outputs = self.core.step()
        self.send(StepResult(outputs, self._newly_scheduled(started)))

    def _newly_scheduled(self, step_started: float) -> dict[str, float]:
        """Queue time of requests that got their first compute in the last step."""
        if not self.unscheduled:
            return {}
        requests = self.core.scheduler.requests
        done = {}
        for rid, arrival in self.unscheduled.items():
            request = requests.get(rid)
            if request is None or request.num_cached_tokens >= 0:  # admitted (or already finished)
                done[rid] = max(0.0, step_started - arrival)
        for rid in done:
            del self.unscheduled[rid]
        return done


def ready_message(core, checkpoint) -> Ready:
    return Ready(
        max_model_len=core.max_model_len,
        vocab_size=checkpoint.arch.vocab_size,
        tokenizer_path=str(checkpoint.tokenizer_path),
        source=str(checkpoint.source),
        num_blocks=core.kv.pool.num_blocks,
        block_size=core.config.cache.block_size,
        pid=os.getpid(),
        worker_pids=list(getattr(core.runner, "worker_pids", [])),
    )


# ---- the process -------------------------------------------------------------


def pick_torch_threads() -> int:
    """One intra-op thread per core this process may run on.

    The engine step is the server's hot path; the API process (HTTP,
    tokenization, detokenization) used ~6% of the engine's CPU time in the
    serving benchmark. Measured on the 2-core box with `kiln serve` +
    `kiln bench serve` (bench/compare.py --serve, 16 prompts of 64-512
    tokens): 2 threads gave 48 / 64 output tok/s at 0.5 req/s / all at once,
    1 thread 37 / 39, and TTFT p99 2.0 s vs 3.6 s at 0.5 req/s. On a machine
    shared with other busy processes fewer threads can win (threads that
    outnumber the free cores wait on each other at every parallel region):
    OMP_NUM_THREADS, when set, wins.
    """
    import torch

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
    from kiln.llm.engine.builder import build_engine_core  # heavy (torch): only in the engine

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
        log.exception("engine failed")
        with contextlib.suppress(OSError):
            send(Failed(f"{type(e).__name__}: {e}"))
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
