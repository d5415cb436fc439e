"""API-side handles on an engine core: in its own process, or in a thread.

Both clients have one interface:
    info = client.start(on_result, on_dead)   # blocks until the engine is ready
    client.add_request(msg); client.abort(ids); client.shutdown()
`on_result(StepResult)` and `on_dead(message)` are called from a background
thread; the caller hops to its own event loop. `on_dead` is called at most
once, and never after `shutdown()` began.
`add_request` / `abort` never block on the engine: they go through a queue.

`prespawn(config)` starts an engine process before any client exists (`kiln
serve` does it before its own imports, so the engine's imports and loading
overlap the API process's); the first ProcessEngineClient started with an
equal config adopts it, and `discard_prespawned()` stops any left unadopted.

A request is encoded for the wire when it is added, on the caller's thread:
one the wire cannot carry (an integer past 64 bits, a lone surrogate) raises
InvalidRequestError there, for that request alone. The writer thread only
moves bytes, and any failure of its pipe is reported as the engine's death,
never a silent stop that would leave every later request waiting.
"""

from __future__ import annotations

import abc
import logging
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

import msgspec

from kiln.config import EngineConfig
from kiln.errors import EngineDeadError, InvalidRequestError, KilnError, ModelLoadError
from kiln.llm.engine.loop import EngineLoop, ready_message
from kiln.llm.engine.messages import (
    Abort,
    AddRequest,
    EngineCoreRequest,
    Failed,
    FromEngine,
    Ready,
    Shutdown,
    StepResult,
    ToEngine,
    encoder,
    from_engine_decoder,
)

log = logging.getLogger(__name__)

OnResult = Callable[[StepResult], None]
OnDead = Callable[[str], None]


class EngineCoreClient(abc.ABC):
    """Shared plumbing: an outgoing queue and the dead/closing flags."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.info: Ready | None = None
        self.closing = False
        self._outgoing: queue.Queue[ToEngine | bytes | None] = queue.Queue()
        self._on_dead: OnDead = lambda message: None
        self._dead_lock = threading.Lock()
        self._dead_reported = False

    def add_request(self, msg: EngineCoreRequest) -> None:
        """Queue a request for the engine; InvalidRequestError if the wire cannot carry it."""
        add = AddRequest(msg)
        self._send(add, wire_frame(add))

    def abort(self, request_ids: list[str]) -> None:
        if request_ids:
            abort = Abort(list(request_ids))
            self._send(abort, wire_frame(abort))

    def _send(self, msg: ToEngine, frame: bytes) -> None:
        """Queue one message: the object (in-process) or its frame (a pipe)."""
        self._outgoing.put(msg)

    def _report_dead(self, message: str) -> None:
        with self._dead_lock:
            if self._dead_reported or self.closing:
                return
            self._dead_reported = True
        log.error("engine core died: %s", message)
        self._on_dead(message)

    @property
    def engine_pid(self) -> int | None:
        return None

    @abc.abstractmethod
    def start(self, on_result: OnResult, on_dead: OnDead) -> Ready:
        """Start the engine; blocks until it is ready (raises EngineDeadError if it fails)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine (blocks until it is gone)."""


# Engine processes started ahead of their client, by config: (process, to it, from it).
_ahead: dict[EngineConfig, tuple[subprocess.Popen, Connection, Connection]] = {}
_ahead_lock = threading.Lock()


def prespawn(config: EngineConfig) -> None:
    """Start `config`'s engine process now (see the module docstring)."""
    client = ProcessEngineClient(config)
    to_engine, from_engine = client._spawn()
    assert client.proc is not None  # set by _spawn
    with _ahead_lock:
        _ahead[config] = (client.proc, to_engine, from_engine)


def discard_prespawned() -> int:
    """Stop the engine processes started ahead that no client adopted; how many."""
    with _ahead_lock:
        left = list(_ahead.values())
        _ahead.clear()
    for proc, to_engine, from_engine in left:
        to_engine.close()  # EOF on its inbox: it would exit by itself; do not wait for that
        from_engine.close()
        proc.kill()
        proc.wait()
    if left:
        log.warning("stopped %d engine process(es) started ahead but not used (their config changed)", len(left))
    return len(left)


def _adopt(config: EngineConfig) -> tuple[subprocess.Popen, Connection, Connection] | None:
    with _ahead_lock:
        return _ahead.pop(config, None)


class ProcessEngineClient(EngineCoreClient):
    """Runs `python -m kiln.llm.engine.core_proc` and talks to it over pipes."""

    def __init__(self, config: EngineConfig, shutdown_timeout_s: float = 10.0):
        super().__init__(config)
        self.shutdown_timeout_s = shutdown_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def engine_pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def _send(self, msg: ToEngine, frame: bytes) -> None:
        self._outgoing.put(frame)

    def start(self, on_result: OnResult, on_dead: OnDead) -> Ready:
        self._on_dead = on_dead
        ahead = _adopt(self.config)
        if ahead is not None:
            self.proc, to_engine, from_engine = ahead
        else:
            to_engine, from_engine = self._spawn()
        first = self._receive(from_engine)
        if not isinstance(first, Ready):
            message = first.message if isinstance(first, Failed) else "engine sent no ready message"
            self._kill()
            unusable = isinstance(first, Failed) and first.unusable_model
            # The model's own fault keeps its kind across the process boundary (a load answers 400 for it).
            raise (ModelLoadError if unusable else EngineDeadError)(f"engine failed to start: {message}")
        self.info = first
        reader = threading.Thread(
            target=self._read_loop, args=(from_engine, on_result), name="kiln-engine-reader", daemon=True
        )
        reader.start()
        threading.Thread(target=self._write_loop, args=(to_engine,), name="kiln-engine-writer", daemon=True).start()
        return first

    def _spawn(self) -> tuple[Connection, Connection]:
        """Start the engine process and send it the config; (to it, from it)."""
        inbox_r, inbox_w = os.pipe()
        outbox_r, outbox_w = os.pipe()
        cmd = [
            sys.executable,
            "-m",
            "kiln.llm.engine.core_proc",
            "--inbox-fd",
            str(inbox_r),
            "--outbox-fd",
            str(outbox_w),
            "--parent-pid",
            str(os.getpid()),
        ]
        try:
            self.proc = subprocess.Popen(cmd, pass_fds=(inbox_r, outbox_w), close_fds=True)
        finally:
            os.close(inbox_r)  # the child's ends: close ours, so EOF means the child is gone
            os.close(outbox_w)
        to_engine = Connection(inbox_w, readable=False, writable=True)
        from_engine = Connection(outbox_r, readable=True, writable=False)
        to_engine.send_bytes(encoder.encode(self.config))
        return to_engine, from_engine

    def _receive(self, from_engine: Connection) -> FromEngine:
        try:
            frame = from_engine.recv_bytes()
        except (EOFError, OSError):
            return Failed(f"engine process exited (code {self._exit_code()})")
        try:
            return from_engine_decoder.decode(frame)
        except Exception as e:  # noqa: BLE001 - a garbled pipe: the engine cannot be trusted any more
            self._kill()
            return Failed(f"unreadable message from the engine ({type(e).__name__}: {e})")

    def _exit_code(self) -> int | None:
        proc = self.proc
        if proc is None:
            return None
        try:
            return proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # closed its pipe yet lives on: finish it
            self._kill()
            return proc.returncode

    def _read_loop(self, from_engine: Connection, on_result: OnResult) -> None:
        while True:
            msg = self._receive(from_engine)
            if isinstance(msg, StepResult):
                try:
                    on_result(msg)
                except Exception as e:  # noqa: BLE001 - e.g. the event loop closed under us
                    if not self.closing:
                        log.exception("engine reader: handing over a result failed")
                        self._kill()
                        self._report_dead(f"engine results cannot be delivered: {type(e).__name__}: {e}")
                    return
            elif isinstance(msg, Failed):
                self._report_dead(msg.message)
                self._exit_code()  # the engine exits after Failed: reap it (no zombie)
                return

    def _write_loop(self, to_engine: Connection) -> None:
        while True:
            frame = self._outgoing.get()
            if frame is None:
                return
            try:
                assert isinstance(frame, bytes)  # this client queues frames only (_send)
                to_engine.send_bytes(frame)
            except Exception as e:  # noqa: BLE001 - a frame may be half written: the pipe is lost
                self._kill()
                self._report_dead(f"cannot reach the engine process: {type(e).__name__}: {e}")
                return

    def shutdown(self) -> None:
        self.closing = True
        if self.proc is None:
            return
        self._outgoing.put(encoder.encode(Shutdown()))
        self._outgoing.put(None)
        try:
            self.proc.wait(timeout=self.shutdown_timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("engine process did not exit in %.0fs; killing it", self.shutdown_timeout_s)
            self._kill()

    def _kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class ThreadEngineClient(EngineCoreClient):
    """The same loop in a thread of this process (tests, offline use).

    The core is touched only by its thread; requests reach it through the queue.
    """

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self._thread: threading.Thread | None = None

    def start(self, on_result: OnResult, on_dead: OnDead) -> Ready:
        # Only the in-process mode builds a model here: the API process of the
        # process mode never imports the model code and kernels.
        from kiln.llm.engine.builder import build_engine_core

        self._on_dead = on_dead
        core, checkpoint = build_engine_core(self.config)
        self.info = info = ready_message(core, checkpoint)
        loop = EngineLoop(core, self._inbox, on_result, lambda: not self.closing)
        self._thread = threading.Thread(target=self._run, args=(loop,), name="kiln-engine-core", daemon=True)
        self._thread.start()
        return info

    def _inbox(self, timeout: float) -> list[ToEngine]:
        taken: list[ToEngine | bytes | None] = []
        try:
            taken.append(self._outgoing.get(timeout=timeout) if timeout > 0 else self._outgoing.get_nowait())
            while True:
                taken.append(self._outgoing.get_nowait())
        except queue.Empty:
            pass
        # None only stops a process client's writer; bytes are a process client's frames.
        return [msg for msg in taken if isinstance(msg, (AddRequest, Abort, Shutdown))]

    def _run(self, loop: EngineLoop) -> None:
        try:
            loop.run()
        except KilnError as e:
            self._report_dead(e.message)
        except Exception as e:
            log.exception("engine core thread failed")
            self._report_dead(f"{type(e).__name__}: {e}")
        finally:
            loop.core.shutdown()

    def shutdown(self) -> None:
        self.closing = True
        self._outgoing.put(Shutdown())
        if self._thread is not None:
            self._thread.join(timeout=30)


def wire_frame(msg: ToEngine) -> bytes:
    """The message as the engine process reads it (the in-process mode checks it the same way)."""
    try:
        return encoder.encode(msg)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as e:
        raise InvalidRequestError(f"the request cannot be sent to the engine: {e}") from None
