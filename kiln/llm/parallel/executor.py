"""The driver side: start the other ranks, then stand in for ModelRunner.

    EngineCore.step ─► ParallelRunner.execute(SchedulerOutput)
                         ├─ StepPlan ──broadcast (msgspec bytes, uint8 tensor)──► every worker
                         ├─ run its own shard (rank 0 = TP rank 0 of stage 0)
                         ├─ receive the gathered logits of the sampled rows
                         └─ sample once, here (same Sampler as one process)

The scheduler, KV block manager and sampler exist only here. A dead worker
turns into EngineDeadError: at once when a collective fails (gloo reports a
closed connection), or at the next health check when a spawned worker's
process has exited while the engine was idle; idle engines also broadcast a
heartbeat now and then, so a dead remote rank is noticed without traffic.
"""
from __future__ import annotations

import atexit
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import NoReturn

import torch

from kiln.config import EngineConfig
from kiln.errors import ConfigError, EngineDeadError, KilnError, ModelLoadError
from kiln.llm.kv_cache.manager import cdiv
from kiln.llm.models.arch import LlamaArch
from kiln.llm.parallel.model import gather_weight_bytes
from kiln.llm.parallel.plan import (
    Heartbeat,
    Plan,
    PlanChunk,
    ReportWeights,
    StepPlan,
    Stop,
    WorkerInit,
    broadcast_plan,
    split_micro_batches,
)
from kiln.llm.parallel.shard_builder import build_stage
from kiln.llm.parallel.stage import MicroBatchLogits
from kiln.llm.parallel.state import join_world, make_tp_groups, shutdown_distributed
from kiln.llm.parallel.weights import WeightReader
from kiln.llm.request import Request
from kiln.llm.sampling.sampler import Sampler
from kiln.llm.scheduler.output import RunnerOutput, SchedulerOutput
from kiln.llm.spec_decode.proposer import Proposer

log = logging.getLogger(__name__)

HEARTBEAT_S = 2.0  # idle time after which a health check pings every rank
POLL_S = 0.2  # how often spawned workers' processes are polled


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerProcesses:
    """Ranks 1..world-1 as child processes of this one, on loopback."""

    def __init__(self, world_size: int, device: str, timeout_s: float):
        self.port = free_port()
        self.procs: list[subprocess.Popen] = []
        threads = max(1, len(os.sched_getaffinity(0)) // world_size)
        for rank in range(1, world_size):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.port), WORLD_SIZE=str(world_size))
            env.update(RANK=str(rank), LOCAL_RANK=str(rank))
            env.setdefault("OMP_NUM_THREADS", str(threads))
            cmd = [sys.executable, "-m", "kiln.llm.parallel.worker", "--parent-pid", str(os.getpid())]
            cmd += ["--device", device, "--dist-timeout-s", str(timeout_s)]
            self.procs.append(subprocess.Popen(cmd, env=env))
        atexit.register(self.kill)

    @property
    def init_method(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def first_exited(self) -> str | None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"worker rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    def wait(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


class ParallelRunner:
    """The Runner (runner/base.py) of a model split over TP x PP ranks; this process is rank 0."""

    def __init__(
        self, config: EngineConfig, arch: LlamaArch, reader: WeightReader, num_blocks: int, max_model_len: int
    ):
        p = config.parallel
        self.config = config
        self.proposer: Proposer | None = None  # speculative decoding is rejected with TP/PP (EngineConfig)
        self.workers: WorkerProcesses | None = None
        self.dead_message: str | None = None
        self._closed = False
        self._last_contact = time.monotonic()
        if p.worker_launch == "spawn":
            self.workers = WorkerProcesses(p.world_size, config.model.device, p.dist_timeout_s)
            init_method = self.workers.init_method
        else:
            problem = driver_env_problem(os.environ, p.world_size)
            if problem is not None:
                raise ConfigError(problem, param="worker_launch")
            init_method = "env://"
        try:
            self.state = join_world(0, p.world_size, init_method, config.model.device, p.dist_timeout_s)
            broadcast_plan(WorkerInit(config, num_blocks, max_model_len))
            make_tp_groups(self.state, p, p.dist_timeout_s)
            self.stage = build_stage(config, arch, reader, self.state, num_blocks, max_model_len)
            failed = torch.zeros(1)
            torch.distributed.all_reduce(failed)
        except BaseException:
            self._teardown(kill=True)
            raise
        if failed.item():
            self._teardown(kill=True)
            raise ModelLoadError(f"{int(failed.item())} worker(s) could not load their shard (see their logs)")
        self.device = self.state.device
        self.model = self.stage.model
        self.sampler = Sampler(self.device, config.model.seed)
        self.last_plan_bytes = 0
        if self.workers is not None:
            threading.Thread(
                target=self._watch_workers, args=(self.workers,), name="kiln-worker-watch", daemon=True
            ).start()

    # ---- health ------------------------------------------------------------------
    def _watch_workers(self, workers: WorkerProcesses) -> None:
        while not self._closed and self.dead_message is None:
            exited = workers.first_exited()
            if exited is not None and not self._closed:
                self.dead_message = exited
                log.error("parallel engine: %s", exited)
                return
            time.sleep(POLL_S)

    def check_health(self) -> None:
        """Raise EngineDeadError if a rank is gone; ping every rank when idle a while."""
        if self.dead_message is not None:
            raise EngineDeadError(f"parallel engine failed: {self.dead_message}")
        if time.monotonic() - self._last_contact > HEARTBEAT_S:
            self._broadcast(Heartbeat())

    def warm_kv_pool(self) -> bool:
        """The pools live in the ranks' processes: nothing to warm from here."""
        return False

    def _broadcast(self, plan: Plan) -> None:
        try:
            self.last_plan_bytes = broadcast_plan(plan)
        except Exception as e:  # gloo: connection closed by peer, or timeout
            self._fail(e)
        self._last_contact = time.monotonic()

    def _fail(self, error: BaseException) -> NoReturn:
        time.sleep(POLL_S * 2)  # let the watcher name the worker that died, if one did
        if self.dead_message is None:
            self.dead_message = f"a collective failed ({type(error).__name__}: {str(error)[:300]})"
        raise EngineDeadError(f"parallel engine failed: {self.dead_message}") from error

    # ---- steps -------------------------------------------------------------------
    def plan(self, sched: SchedulerOutput, all_logits: bool = False) -> StepPlan:
        bs = self.stage.block_size
        chunks = []
        for i, c in enumerate(sched.chunks):
            end = c.start + c.num_tokens
            chunks.append(
                PlanChunk(
                    i, list(c.token_ids()), c.start, c.num_tokens, list(c.block_ids[: cdiv(end, bs)]), c.sample,
                    feeds_prompt=c.feeds_prompt,
                )
            )
        parts = self.config.parallel.num_micro_batches or self.state.pp_size
        micro = split_micro_batches([c.num_tokens for c in chunks], parts if self.state.pp_size > 1 else 1)
        return StepPlan(chunks, micro, all_logits)

    def _run(self, plan: StepPlan) -> list[MicroBatchLogits]:
        self.check_health()
        self._broadcast(plan)
        try:
            results = self.stage.run(plan)
        except KilnError:
            raise
        except Exception as e:
            self._fail(e)
        self._last_contact = time.monotonic()
        return results

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        results = self._run(self.plan(sched))
        if not results:
            return RunnerOutput()
        logits = torch.cat([r.logits for r in results])
        requests = [sched.chunks[c.index].request for r in results for c in r.chunks]
        tokens = self.sampler(logits, requests)
        return RunnerOutput({r.request_id: t for r, t in zip(requests, tokens, strict=False)})

    def propose(self, requests: list[Request], num_drafts: list[int]) -> list[list[int]]:
        return [[] for _ in requests]

    def logits_for(self, sched: SchedulerOutput) -> torch.Tensor:
        """Test hook: logits for every fed token (micro-batch order)."""
        return torch.cat([r.logits for r in self._run(self.plan(sched, all_logits=True))])

    def resident_weight_bytes(self) -> list[int]:
        """Bytes of parameter storage each rank actually holds, by rank."""
        self.check_health()
        self._broadcast(ReportWeights())
        try:
            return gather_weight_bytes(self.model)
        except Exception as e:
            self._fail(e)

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.workers.procs] if self.workers else []

    # ---- shutdown ----------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        healthy = self.dead_message is None
        if healthy:
            try:
                broadcast_plan(Stop())
            except Exception:
                healthy = False
        self._teardown(kill=not healthy)

    def _teardown(self, kill: bool) -> None:
        self._closed = True
        if self.workers is not None:
            if kill:
                self.workers.kill()
            else:
                self.workers.wait(10.0)
        try:
            shutdown_distributed()
        except Exception:
            log.exception("destroying the process group failed")


def driver_env_problem(env: Mapping[str, str], world_size: int) -> str | None:
    """What is wrong with the driver's torchrun-style environment (`worker_launch="env"`), before it
    waits for ranks: no MASTER_ADDR was a 42-line torch traceback, a WORLD_SIZE other than TP x PP
    was ignored (the ranks started for it waited out the timeout)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not env.get(name)]
    if missing:
        return f"--worker-launch env needs {missing[0]} set (torchrun-style: MASTER_ADDR, MASTER_PORT; RANK 0 here)"
    rank, world = env.get("RANK", "0").strip(), env.get("WORLD_SIZE", str(world_size)).strip()
    if rank != "0":
        return f"the driver must be RANK 0 (got RANK={rank!r}); start other ranks with `kiln worker`"
    if world != str(world_size):
        return (f"WORLD_SIZE={world!r}, but tensor_parallel_size x pipeline_parallel_size is {world_size}: "
                "start that many ranks in all")
    return None
