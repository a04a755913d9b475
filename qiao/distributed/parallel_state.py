"""The tensor-parallel group of this process: its rank, its size and the collectives the
parallel layers call.

One process per rank. Without `init_tensor_parallel` (or with size 1) the group is this process
alone and every collective is the identity, so single-process code pays nothing. gloo on the
CPU, NCCL on CUDA.
"""

from __future__ import annotations

import atexit
import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qiao.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1


_STATE = TensorParallel()


def init_tensor_parallel(
    rank: int, size: int, init_method: str, backend: str = "gloo", timeout_s: float = 600.0
) -> None:
    """Join the group of `size` processes at `init_method` (e.g. tcp://127.0.0.1:PORT) as
    `rank`; size 1 needs no group."""
    global _STATE
    if not 0 <= rank < size:
        raise ConfigError(f"tensor parallel rank {rank} outside a group of {size}")
    if size > 1:
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    _STATE = TensorParallel(rank, size)
    if size > 1:
        atexit.register(destroy_tensor_parallel)


def destroy_tensor_parallel() -> None:
    global _STATE
    if _STATE.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
    _STATE = TensorParallel()


def tp_rank() -> int:
    return _STATE.rank


def tp_size() -> int:
    return _STATE.size


def divide(total: int, what: str) -> int:
    """`total` split evenly over the group; a ConfigError naming `what` when it cannot be."""
    size = _STATE.size
    if total % size:
        raise ConfigError(f"tensor_parallel_size {size}: {what} ({total}) must divide evenly by it")
    return total // size


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the group, in place (identity at size 1)."""
    if _STATE.size > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension, in rank order."""
    if _STATE.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank, in place."""
    if _STATE.size > 1:
        dist.broadcast(x, src=0)
    return x
