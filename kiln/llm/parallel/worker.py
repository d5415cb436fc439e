"""A non-driver rank: join the group, load its shard, run plans until Stop.

Started by the driver on this machine (`worker_launch="spawn"`), or by hand /
torchrun on another machine with MASTER_ADDR, MASTER_PORT, WORLD_SIZE and
RANK set (`kiln worker`, or `python -m kiln.llm.parallel.worker`). The model
path and every option arrive from the driver in the WorkerInit message, so a
worker needs only the environment (and the model files at the same path).

A worker exits when told to, when any collective fails (a peer died), or when
its parent is gone (spawned workers), so it never outlives the server.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Mapping

import torch

from kiln.config import MAX_DIST_TIMEOUT_S
from kiln.llm.models.default_model import resolve_model_path
from kiln.llm.parallel.model import gather_weight_bytes
from kiln.llm.parallel.plan import Heartbeat, ReportWeights, StepPlan, Stop, WorkerInit, receive_plan
from kiln.llm.parallel.shard_builder import build_stage
from kiln.llm.parallel.state import join_world, make_tp_groups, shutdown_distributed
from kiln.llm.parallel.weights import open_weights
from kiln.llm.parent_watch import watch_parent

log = logging.getLogger(__name__)


def run_worker(rank: int, world_size: int, init_method: str, device: str, timeout_s: float) -> int:
    state = join_world(rank, world_size, init_method, device, timeout_s)
    try:
        init = receive_plan()
        if not isinstance(init, WorkerInit):
            raise RuntimeError(f"expected WorkerInit first, got {type(init).__name__}")
        config = init.config
        make_tp_groups(state, config.parallel, timeout_s)
        failed = torch.zeros(1)
        stage = None
        try:
            arch, reader, _ = open_weights(resolve_model_path(config))  # the driver's resolved path
            stage = build_stage(config, arch, reader, state, init.num_blocks, init.max_model_len)
            del reader
        except Exception:
            log.exception("rank %d could not load its shard", rank)
            failed += 1
        torch.distributed.all_reduce(failed)
        if stage is None or failed.item():
            return 1
        log.info("rank %d ready: tp %d/%d, pp %d/%d", rank, state.tp_rank, state.tp_size, state.pp_rank, state.pp_size)
        while True:
            plan = receive_plan()
            if isinstance(plan, StepPlan):
                stage.run(plan)
            elif isinstance(plan, ReportWeights):
                gather_weight_bytes(stage.model)
            elif isinstance(plan, Stop):
                return 0
            elif not isinstance(plan, Heartbeat):
                raise RuntimeError(f"unexpected message {type(plan).__name__}")
    finally:
        shutdown_distributed()


def setting_problem(env: Mapping[str, str], device: str, timeout_s: float) -> str | None:
    """What is wrong with a worker's environment and flags, before it waits on the driver
    (RANK=5 of WORLD_SIZE=2 waited out the whole timeout; RANK=abc was a traceback)."""
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK") if name not in env]
    if missing:
        return f"set {missing[0]} (torchrun-style: MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK)"
    numbers = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        text = env[name].strip()
        if not (text.isascii() and text.isdigit()):
            return f"{name} must be a non-negative integer, got {env[name]!r}"
        numbers[name] = int(text)
    rank, world = numbers["RANK"], numbers["WORLD_SIZE"]
    if rank == 0:
        return "RANK 0 is the driver; start it with `kiln serve ... --worker-launch env`"
    if not 1 <= rank < world:
        return f"RANK must be in [1, WORLD_SIZE) = [1, {world}), got {rank}"
    if not 1 <= numbers["MASTER_PORT"] <= 65535:
        return f"MASTER_PORT must be in [1, 65535], got {numbers['MASTER_PORT']}"
    if not 0 < timeout_s <= MAX_DIST_TIMEOUT_S:
        return f"--dist-timeout-s must be in (0, {MAX_DIST_TIMEOUT_S:g}], got {timeout_s}"
    if device.split(":")[0] not in ("cpu", "cuda"):
        return f"--device must be cpu or cuda, got {device!r}"
    if device.startswith("cuda") and not torch.cuda.is_available():
        return "--device cuda, but this torch has no CUDA device"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Kiln parallel worker (one TP/PP rank).")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone (spawned workers)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (must match the driver's)")
    parser.add_argument("--dist-timeout-s", type=float, default=300.0)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("KILN_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s worker {os.environ.get('RANK')} %(levelname)s %(message)s"
    )
    if args.parent_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver coordinates shutdown
        watch_parent(args.parent_pid)
    problem = setting_problem(os.environ, args.device, args.dist_timeout_s)
    if problem is not None:
        print(f"kiln worker: {problem}", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    try:
        return run_worker(rank, world, "env://", args.device, args.dist_timeout_s)
    except Exception:
        log.exception("worker rank %d failed", rank)
        return 1


if __name__ == "__main__":
    sys.exit(main())
