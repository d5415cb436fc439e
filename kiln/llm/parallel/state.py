"""This rank's place in the world, its process groups, and the collectives
the model calls (all no-ops when there is one rank).

`join_world` joins the group (env:// rendezvous from the torchrun-style
MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK; or tcp:// for spawned workers);
gloo on CPU, NCCL (+ gloo for CPU-side plans) on CUDA. `make_tp_groups`
then creates every TP group on every rank, in the same order (a
torch.distributed rule).
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln.config import ParallelConfig
from kiln.errors import ConfigError


@dataclass
class CommStats:
    """Counters of this rank's TP collectives (off unless a benchmark sets them)."""

    all_reduces: int = 0
    all_reduce_bytes: int = 0
    all_reduce_s: float = 0.0
    gathers: int = 0
    gather_bytes: int = 0
    gather_s: float = 0.0


@dataclass
class ParallelState:
    rank: int = 0
    tp_size: int = 1
    pp_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp_group: dist.ProcessGroup | None = None  # this rank's stage; None when tp_size == 1
    stats: CommStats | None = None  # set to count and time collectives (bench/parallel_overhead.py)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def global_rank(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tp_size + tp_rank

    @property
    def logits_rank(self) -> int:
        """The rank holding full logits after the TP gather: TP rank 0 of the last stage."""
        return self.global_rank(self.pp_size - 1, 0)

    # ---- collectives the model uses --------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over this stage's TP ranks (the one communication of a row-parallel layer)."""
        if self.tp_size > 1:
            started = time.perf_counter() if self.stats else 0.0
            dist.all_reduce(x, group=self.tp_group)
            if self.stats:
                self.stats.all_reduces += 1
                self.stats.all_reduce_bytes += x.numel() * x.element_size()
                self.stats.all_reduce_s += time.perf_counter() - started
        return x

    def gather_vocab(self, local: torch.Tensor) -> torch.Tensor | None:
        """[rows, V/tp] per TP rank -> [rows, tp * V/tp] on TP rank 0, None elsewhere."""
        if self.tp_size == 1:
            return local
        local = local.contiguous()
        dst = self.global_rank(self.pp_rank, 0)
        parts = [torch.empty_like(local) for _ in range(self.tp_size)] if self.tp_rank == 0 else None
        started = time.perf_counter() if self.stats else 0.0
        dist.gather(local, parts, dst=dst, group=self.tp_group)
        if self.stats:
            self.stats.gathers += 1
            self.stats.gather_bytes += local.numel() * local.element_size() * self.tp_size
            self.stats.gather_s += time.perf_counter() - started
        return torch.cat(parts, dim=-1) if parts is not None else None


def backend_for(device: torch.device) -> str:
    """gloo on CPU; on CUDA, NCCL for the model's tensors and gloo for the
    small CPU-side plan broadcasts (one group, two backends)."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def rank_device(model_device: str, rank: int) -> torch.device:
    """cpu, or this rank's own GPU (LOCAL_RANK when set, as torchrun sets it)."""
    device = torch.device(model_device)
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count())))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def join_world(rank: int, world_size: int, init_method: str, model_device: str, timeout_s: float) -> ParallelState:
    """Join the world group (blocks until every rank has joined or the timeout).

    TP/PP sizes are filled in by `make_tp_groups` (workers learn them from
    the driver's WorkerInit, after joining)."""
    if dist.is_initialized():
        raise ConfigError("a parallel engine is already running in this process; shut it down first")
    device = rank_device(model_device, rank)
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        world_size=world_size,
        rank=rank,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return ParallelState(rank=rank, tp_size=1, pp_size=world_size, device=device)


def make_tp_groups(state: ParallelState, config: ParallelConfig, timeout_s: float) -> None:
    """Every rank creates every TP group, in the same order (a torch.distributed rule)."""
    if config.world_size != dist.get_world_size():
        raise ConfigError(
            f"the group has {dist.get_world_size()} ranks but tensor_parallel_size x pipeline_parallel_size "
            f"= {config.world_size}",
            param="tensor_parallel_size",
        )
    state.tp_size, state.pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    if state.tp_size == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    for pp in range(state.pp_size):
        group = dist.new_group([state.global_rank(pp, t) for t in range(state.tp_size)], timeout=timeout)
        if pp == state.pp_rank:
            state.tp_group = group


def shutdown_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
