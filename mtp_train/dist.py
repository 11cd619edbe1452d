"""Process group setup for torchrun (or one plain process): gloo on CPU, nccl on GPU, via DeepSpeed's comm."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(device: str) -> tuple[int, int, torch.device]:
    """(rank, world_size, this rank's device). A plain `python -m` run becomes a world of one."""
    if "RANK" not in os.environ:  # not launched by torchrun: a single-process world
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # noqa: PLC0415 - after DS_ACCELERATOR is set

    if not use_cuda:  # DeepSpeed's CPU shared-memory all-reduce JIT-compiles for a minute: gloo is enough here
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="nccl" if use_cuda else "gloo", auto_mpi_discovery=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def local_part() -> tuple[int, int]:
    """(this rank's index among its node's ranks, their number) under torchrun; (0, 1) in a world of one."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        return int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return 0, 1


def all_gather_lists(items: list) -> list:
    """Every rank's picklable items, concatenated in rank order (a world of one: its own items)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, items)
        return [item for part in gathered for item in part]
    return list(items)


def shutdown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
