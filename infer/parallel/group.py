"""The tensor-parallel process group (`TPGroup`), the group models shard over (`current`), and joining one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

ERROR_KEY = "specforge/tp/error"  # + "/<replica>": each replica's first failure
PEER_ERROR_WAIT = timedelta(seconds=5)  # how long a rank whose collective broke waits for the culprit's message


class ShardingError(ValueError):
    """A model shape that the requested number of ranks does not split; the message names the field."""


class RemoteRankError(RuntimeError):
    """Another rank failed; the message is that rank's own one-line error."""


def divisors(n: int) -> list[int]:
    return [t for t in range(1, n + 1) if n % t == 0]


# every rank's tensor into one flat buffer, rank by rank (torch renamed all_gather_into_tensor to this)
_ALL_GATHER_FLAT = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(eq=False)
class TPGroup:
    """This process's place in the tensor-parallel group (size 1: no parallelism, every collective a no-op)."""

    rank: int = 0
    size: int = 1
    store: dist.Store | None = None  # the rendezvous store: where a failing rank leaves its error
    device: torch.device = torch.device("cpu")  # where step broadcasts land
    group: dist.ProcessGroup | None = None  # None: the whole world
    replica: int = 0  # which of the world's data-parallel replicas this group is (init_tp(replicas=True))
    replicas: int = 1
    sum_by_gather: bool = False  # all_reduce as one all-gather and a local sum (gloo: see all_reduce)

    @property
    def error_key(self) -> str:
        return f"{ERROR_KEY}/{self.replica}"

    @property
    def global_rank(self) -> int:
        return self.replica * self.size + self.rank

    def __deepcopy__(self, memo: dict) -> "TPGroup":
        return self  # a handle on the process group, shared by every copy of a model

    def span(self, n: int, field: str) -> tuple[int, int]:
        """This rank's even share [lo, hi) of n items (heads, features, vocabulary rows)."""
        if n % self.size:
            raise ShardingError(f"{field}={n} does not split over tp={self.size} ranks: choose tp in {divisors(n)}")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place.

        On gloo (CPU) as an all-gather and a sum in rank order, the same on every rank: gloo's all-reduce of a
        decode step's activations waits on several more message hops than one all-gather, and a decoder layer
        all-reduces twice (see docs/benchmark_history.md). NCCL's all-reduce stays."""
        if self.size == 1 or not x.numel():
            return x
        if not self.sum_by_gather:
            self._collective(dist.all_reduce, x, group=self.group)
            return x
        return torch.sum(self._stacked(x), dim=0, out=x)

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x, concatenated along dim in rank order."""
        if self.size == 1:
            return x
        if not x.numel():  # no rows: the same on every rank, nothing to move
            shape = list(x.shape)
            shape[dim] *= self.size
            return x.new_empty(shape)
        dim %= x.dim()
        return self._stacked(x).movedim(0, dim).flatten(dim, dim + 1)

    def _stacked(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: every rank's x in rank order, gathered into one flat buffer by one collective (see
        all_reduce)."""
        parts = x.new_empty(self.size * x.numel())
        self._collective(_ALL_GATHER_FLAT, parts, x.contiguous().view(-1), group=self.group)
        return parts.view(self.size, *x.shape)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x, into x on every rank."""
        self._collective(dist.broadcast, x, group=self.group, group_src=0)
        return x

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's picklable obj, returned on every rank (what the other ranks pass is ignored)."""
        if self.size == 1:
            return obj
        box = [obj]
        self._collective(dist.broadcast_object_list, box, group=self.group, group_src=0)
        return box[0]

    def _collective(self, collective: Callable, *args, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as err:  # a peer left the group (it failed) or died
            raise self.peer_error(err) from None

    def peer_error(self, err: BaseException) -> RemoteRankError:
        """The failing rank's message from the store (it writes it before leaving the group)."""
        try:
            self.store.wait([self.error_key], PEER_ERROR_WAIT)
            message = self.store.get(self.error_key).decode()
            self.store.set(f"{self.error_key}/seen/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - no rank left a message (or the store is gone): say what this rank saw
            message = f"rank {self.global_rank}: a collective failed and no rank reported why: {one_line(err)}"
        return RemoteRankError(message)


_CURRENT = TPGroup()


def current() -> TPGroup:
    """The group models shard over unless told otherwise: the one `init_tp` joined, else a single rank."""
    return _CURRENT


@contextlib.contextmanager
def sharding_over(tp: TPGroup) -> Iterator[None]:
    """Build models sharded over `tp` meanwhile (a group of one: whole), whatever `current()` is outside."""
    global _CURRENT
    saved, _CURRENT = _CURRENT, tp
    try:
        yield
    finally:
        _CURRENT = saved


def single_rank() -> contextlib.AbstractContextManager:
    """Build whole models meanwhile: a draft LM under tensor parallelism lives on rank 0 only."""
    return sharding_over(TPGroup(device=_CURRENT.device))


def attach_where_it_lives(kind: str, attach: Callable[[], None]) -> None:
    """Run `attach` (which loads a drafter) on the ranks that hold that drafter: a draft LM ("draft") on rank 0
    only, whole (its plain runner broadcasts nothing); a head ("mtp", "eagle3") on every rank, sharded like the
    target."""
    if kind != "draft":
        attach()
    elif current().rank == 0:
        with single_rank():
            attach()


def init_tp(tp: int, device: str | torch.device = "cpu", replicas: bool = False, option: str | None = None) -> TPGroup:
    """Join the torchrun group as one of `tp` tensor-parallel ranks (tp=1 outside torchrun: one plain process).

    replicas=True: WORLD_SIZE may be any multiple of tp; ranks [d*tp, (d+1)*tp) form replica d, each its own
    process group, and the group returned is this rank's replica. A process group that already exists (a
    trainer's, from DeepSpeed) is joined, not created. gloo on CPU, nccl on CUDA (rank r on cuda:LOCAL_RANK).
    The group becomes `current()`, which models shard over. `option` names the setting in errors (default --tp).
    """
    global _CURRENT
    option = option or f"--tp {tp}"
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    if tp < 1:
        raise ShardingError(f"{option}: the number of tensor-parallel ranks must be >= 1")
    if world % tp if replicas else world != tp:
        needs, procs = (f"a multiple of {tp} processes", f"{tp} x replicas") if replicas else (f"{tp} processes", tp)
        raise ShardingError(f"{option} needs {needs}: run it as `torchrun --nproc_per_node {procs} ...` "
                            f"(WORLD_SIZE is {world})")
    device = torch.device(device)
    if world == 1:
        _CURRENT = TPGroup(device=device)
        return _CURRENT
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store, rank, world = next(dist.rendezvous("env://"))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world)
    group = dist.new_subgroups(tp)[0] if 1 < tp < world else None  # collective: every rank makes every replica's
    rank = dist.get_rank()
    _CURRENT = TPGroup(rank % tp, tp, dist.distributed_c10d._get_default_store(), device, group, rank // tp, world // tp,
                       sum_by_gather=dist.get_backend(group) == "gloo")
    return _CURRENT



def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__
