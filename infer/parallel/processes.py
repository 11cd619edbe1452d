"""A rank's life under torchrun (a failure reaches every rank, rank 0 stops the others), and ranks spawned
without it (tests, reports)."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import sys
import time
from collections.abc import Callable

import torch.distributed as dist
import torch.multiprocessing as mp

from infer.parallel.group import PEER_ERROR_WAIT, RemoteRankError, TPGroup, current, one_line
from infer.parallel.step_broadcast import stop_workers


def fail(err: BaseException, tp: TPGroup | None = None) -> None:
    """This rank failed: leave its one-line error in the store and the group, so no other rank waits on it.

    Rank 0 hosts the store outside torchrun, so it lingers until the others have read its error.
    """
    tp = tp or current()
    if tp.size == 1 or not dist.is_initialized():
        return
    culprit = not isinstance(err, RemoteRankError)  # a RemoteRankError is already some other rank's report
    if culprit:
        tp.store.compare_set(tp.error_key, "", f"rank {tp.global_rank}: {type(err).__name__}: {one_line(err)}")
    with contextlib.suppress(Exception):  # a group broken by the failure may not tear down cleanly
        dist.destroy_process_group()
    if culprit and tp.rank == 0:
        with contextlib.suppress(Exception):
            tp.store.wait([f"{tp.error_key}/seen/{r}" for r in range(1, tp.size)], PEER_ERROR_WAIT)


def tp_main(fn: Callable[[], int]) -> Callable[[], int]:
    """Wrap a CLI's main for torchrun: rank 0 stops the workers when it returns; any rank's error reaches all.

    A rank that fails tells the others (`fail`); a rank stopped by another's error prints it on one line.
    """

    @functools.wraps(fn)
    def main() -> int:
        try:
            code = fn()
        except BaseException as err:
            fail(err)
            if isinstance(err, RemoteRankError):
                print(f"error: {err}", file=sys.stderr)
                return 1
            raise
        stop_workers()
        if dist.is_initialized():
            dist.destroy_process_group()
        return code

    return main


def spawn(fn: Callable[..., None], nprocs: int, *args, timeout_s: float = 300.0) -> None:
    """Run fn(*args) in `nprocs` fresh processes with torchrun's environment (CPU: they call init_tp(nprocs)).

    Raises with the failing rank's traceback, or after timeout_s (a hang), killing the processes.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    context = mp.start_processes(_spawned, args=(nprocs, port, fn, args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"{nprocs} tensor-parallel processes still running after {timeout_s:.0f} s")


def _spawned(rank: int, nprocs: int, port: int, fn: Callable[..., None], args: tuple) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs))
    fn(*args)
    if dist.is_initialized():  # a gloo group left standing can abort the process at exit
        dist.destroy_process_group()
