"""Distributed data-parallel plumbing for the trainer: which process this is (rank, local rank and world size,
read from the environment `torchrun` sets), the process group (gloo on CPU, NCCL on CUDA) and the few
collectives training needs.

One process (no `WORLD_SIZE`, or `WORLD_SIZE=1`) is world size 1: the trainer then calls none of the
collectives below, so the single-process path runs exactly as it would without this module.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class DistributedError(ValueError):
    """A distributed launch that cannot work; the message says how to fix it."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0  # this process among all of them, 0..world_size-1
    local_rank: int = 0  # this process among those on its machine: the GPU it drives
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0 alone logs, shows progress and writes checkpoints and metrics."""
        return self.rank == 0


def dist_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """The process's place in the job, from torchrun's `RANK`, `LOCAL_RANK` and `WORLD_SIZE`."""
    environ = os.environ if environ is None else environ
    values = {}
    for name, default in (("WORLD_SIZE", "1"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        raw = environ.get(name, default)
        try:
            values[name] = int(raw)
        except ValueError:
            raise DistributedError(f"environment variable {name}={raw!r} is not an integer") from None
    world, rank, local = values["WORLD_SIZE"], values["RANK"], values["LOCAL_RANK"]
    if world < 1 or not 0 <= rank < world or local < 0:
        raise DistributedError(f"inconsistent launch: RANK={rank}, LOCAL_RANK={local}, WORLD_SIZE={world}; "
                               "start distributed runs with torchrun, which sets all three")
    if world > 1 and "RANK" not in environ:
        raise DistributedError(f"WORLD_SIZE={world} but no RANK: start distributed runs with torchrun")
    return DistEnv(rank=rank, local_rank=local, world_size=world)


def init(env: DistEnv, device: torch.device) -> None:
    """Join the process group (`MASTER_ADDR`/`MASTER_PORT` from torchrun): NCCL for CUDA, gloo for CPU."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        dist.init_process_group("nccl", rank=env.rank, world_size=env.world_size, device_id=device)
    else:
        dist.init_process_group("gloo", rank=env.rank, world_size=env.world_size)


def close() -> None:
    """Wait until every rank is done (rank 0 may still be writing), then leave the process group."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _comm_device(device: torch.device) -> torch.device:
    return device if dist.get_backend() == "nccl" else torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The elementwise sum of `tensor` over all ranks (a new CPU tensor on every rank)."""
    t = tensor.detach().to(_comm_device(device), copy=True)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def mean_over_ranks(value: float, device: torch.device) -> float:
    """The mean of one number over all ranks (summed in float64)."""
    total = all_reduce_sum(torch.tensor([value], dtype=torch.float64), device)
    return total.item() / dist.get_world_size()


def any_rank(flag: bool, device: torch.device) -> bool:
    """True on every rank if `flag` is true on any; also a barrier."""
    return bool(all_reduce_sum(torch.tensor([int(flag)], dtype=torch.int64), device).item())


def gather(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order, on every rank."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
