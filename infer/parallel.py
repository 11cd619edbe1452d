"""Tensor parallelism: the process group, the sharded layers, and rank 0's step broadcast.

One scheduler runs on rank 0. Every rank builds the same models (each loading only its shard of them) and the
same ModelRunners in the same order; a tensor-parallel runner on rank 0 broadcasts each step's inputs (a header,
then one byte buffer) before running it, and every other rank's `serve_forever` loop runs the same forward on
its shard and its own KV cache (the same page ids). A draft LM stays whole on rank 0: its plain runner
broadcasts nothing, so the other ranks just wait for the next target step.

Layers split as in Megatron-LM: column-parallel projections keep a rank's output features (its heads, its
slice of the MLP), row-parallel ones its input features and all-reduce their outputs; the embedding and the
lm_head split the vocabulary, and the logits are all-gathered, so the sampler sees whole rows.

A rank that fails writes its one-line error into the rendezvous store and leaves the group: the other ranks'
next collective fails, and they raise that error (`RemoteRankError`) instead of waiting forever.

A world of T x D ranks may also hold D data-parallel replicas of T ranks each (`init_tp(T, replicas=True)`: the
feature precompute, a trainer's validation); each replica is its own process group with its own rank 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from infer.kv_cache import PageMetadata

if TYPE_CHECKING:
    from infer.model_runner import ModelRunner

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
        decode step's activations waits on several more message hops than one all-gather (2 ranks on loopback:
        1.7-1.9 ms against 0.7 ms for 64 floats, 1.4 against 0.8 ms for 32k), and a decoder layer all-reduces
        twice. NCCL's all-reduce stays."""
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


# --- sharded layers --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    """The part of a full parameter a rank holds: `ranges` [lo, hi) along `dim` of the `full` shape, concatenated."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    full: tuple[int, ...]

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.cat([tensor.narrow(self.dim, lo, hi - lo) for lo, hi in self.ranges], dim=self.dim)


class _Sharded(nn.Module):
    """Parameters that are shards (`tp_shards`: name -> Shard); load_state_dict also takes the whole tensors.

    The loader reads only a rank's slices from safetensors; whole tensors come from places that hold them
    anyway (an MTP head's own small file), and are cut here.
    """

    tp_shards: dict[str, Shard]

    def _load_from_state_dict(self, state_dict: dict, prefix: str, *args, **kwargs) -> None:
        for name, shard in self.tp_shards.items():
            tensor = state_dict.get(prefix + name)
            if tensor is not None and tuple(tensor.shape) == shard.full:
                state_dict[prefix + name] = shard.take(tensor)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class ColumnParallelLinear(_Sharded, nn.Linear):
    """The output features `rows` (ranges of the full out_features) of a Linear; no communication."""

    def __init__(self, in_features: int, out_features: int, rows: Sequence[tuple[int, int]], bias: bool,
                 tp: TPGroup) -> None:
        super().__init__(in_features, sum(hi - lo for lo, hi in rows), bias=bias)
        self.tp = tp
        self.tp_shards = {"weight": Shard(0, tuple(rows), (out_features, in_features))}
        if bias:
            self.tp_shards["bias"] = Shard(0, tuple(rows), (out_features,))


class RowParallelLinear(_Sharded, nn.Linear):
    """The input features [lo, hi) of a Linear: partial outputs, summed over the ranks (bias added once, by rank 0).

    reduce=False leaves the sum to the caller, so a block that adds several partial outputs reduces once.
    """

    def __init__(self, in_features: int, out_features: int, cols: tuple[int, int], bias: bool, tp: TPGroup,
                 reduce: bool = True) -> None:
        super().__init__(cols[1] - cols[0], out_features, bias=bias)
        self.tp, self.reduce = tp, reduce
        self.tp_shards = {"weight": Shard(1, (cols,), (out_features, in_features))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias if self.tp.rank == 0 else None)
        return self.tp.all_reduce(y) if self.reduce else y


class VocabParallelEmbedding(_Sharded, nn.Module):
    """This rank's rows of the embedding; other ranks' tokens look up zeros here and the all-reduce fills them."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp  # the whole table's
        self.rows = tp.span(num_embeddings, "vocab_size")
        self.weight = nn.Parameter(torch.empty(self.rows[1] - self.rows[0], embedding_dim).normal_())
        self.tp_shards = {"weight": Shard(0, (self.rows,), (num_embeddings, embedding_dim))}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        lo, hi = self.rows
        elsewhere = (input_ids < lo) | (input_ids >= hi)
        x = F.embedding((input_ids - lo).masked_fill(elsewhere, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(elsewhere[..., None], 0))


class ParallelLMHead(_Sharded, nn.Module):
    """This rank's vocabulary rows of the output projection; the logits are gathered to every rank, whole."""

    def __init__(self, hidden_size: int, vocab_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        lo, hi = tp.span(vocab_size, "vocab_size")
        self.weight = nn.Parameter(torch.empty(hi - lo, hidden_size).normal_())
        self.tp_shards = {"weight": Shard(0, ((lo, hi),), (vocab_size, hidden_size))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] -> [N, vocab]."""
        return self.tp.all_gather(F.linear(x, self.weight), dim=-1)


def column_linear(in_features: int, out_features: int, rows: Sequence[tuple[int, int]], bias: bool,
                  tp: TPGroup) -> nn.Linear:
    """A Linear keeping output features `rows` on this rank; a plain Linear on a single rank."""
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return ColumnParallelLinear(in_features, out_features, rows, bias, tp)


def row_linear(in_features: int, out_features: int, cols: tuple[int, int], bias: bool, tp: TPGroup,
               reduce: bool = True) -> nn.Linear:
    """A Linear keeping input features [lo, hi) on this rank, outputs summed over ranks; plain on a single rank."""
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, cols, bias, tp, reduce)


def vocab_embedding(vocab_size: int, hidden_size: int, tp: TPGroup) -> nn.Module:
    return nn.Embedding(vocab_size, hidden_size) if tp.size == 1 else VocabParallelEmbedding(vocab_size, hidden_size, tp)


def lm_head_linear(hidden_size: int, vocab_size: int, tp: TPGroup) -> nn.Module:
    return nn.Linear(hidden_size, vocab_size, bias=False) if tp.size == 1 else ParallelLMHead(hidden_size, vocab_size, tp)


def check_split(tp: TPGroup, fields: dict[str, int], num_kv_heads: int | None = None) -> None:
    """Refuse a tp that does not split every field evenly (KV heads may instead be replicated: tp a multiple of
    them), naming the first field it fails and the tp values that suit them all."""

    def fits(t: int, field: str, n: int) -> bool:
        return n % t == 0 or (field == "num_key_value_heads" and t % n == 0)

    fields = {**fields, **({} if num_kv_heads is None else {"num_key_value_heads": num_kv_heads})}
    bad = next((f for f, n in fields.items() if not fits(tp.size, f, n)), None)
    if bad is not None:
        even = [n for f, n in fields.items() if f != "num_key_value_heads"]
        allowed = [t for t in divisors(min(even)) if all(fits(t, f, n) for f, n in fields.items())]
        raise ShardingError(f"{bad}={fields[bad]} does not split over tp={tp.size} ranks: choose tp in {allowed}")


def head_spans(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[tuple[int, int], tuple[int, int]]:
    """This rank's query heads and KV heads (GQA): an even share of each, or, with fewer KV heads than ranks,
    the one KV head its query heads attend to (KV heads are then replicated over tp // num_kv_heads ranks)."""
    check_split(tp, {"num_attention_heads": num_heads}, num_kv_heads)
    if num_kv_heads >= tp.size:
        return tp.span(num_heads, "num_attention_heads"), tp.span(num_kv_heads, "num_key_value_heads")
    kv = tp.rank * num_kv_heads // tp.size
    return tp.span(num_heads, "num_attention_heads"), (kv, kv + 1)


def group_of(model: nn.Module) -> TPGroup:
    """The group a model is sharded over (a single rank when nothing in it is sharded)."""
    return next((m.tp for m in model.modules() if getattr(m, "tp", None) is not None and m.tp.size > 1), TPGroup())


def parameter_bytes(model: nn.Module) -> int:
    """What this rank holds of a model's parameters (tied ones once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def whole_weight(module: nn.Module) -> torch.Tensor:
    """A vocabulary-parallel module's whole weight, gathered (every rank takes part); any other module's weight."""
    if isinstance(module, (VocabParallelEmbedding, ParallelLMHead)):
        return module.tp.all_gather(module.weight.detach(), dim=0)
    return module.weight


# --- the step broadcast ----------------------------------------------------------------------------------------

_STEP, _STOP = 0, 1
_DTYPES = (torch.int32, torch.int64, torch.float32, torch.bfloat16, torch.float16)
_META_TENSORS = tuple(f.name for f in dataclasses.fields(PageMetadata) if "Tensor" in str(f.type))
# the metadata's ints and flags (not decode_run: the other ranks plan each step of a decode run on their own)
_META_INTS = tuple(f.name for f in dataclasses.fields(PageMetadata) if str(f.type) in ("int", "bool"))
# op, runner id, the metadata's ints, then (dtype, rows, cols) for input_ids, logits_indices, hidden_states,
# aux_layers and each metadata tensor
_HEADER_LEN = 2 + len(_META_INTS) + 3 * (4 + len(_META_TENSORS))
_HEADER_BYTES = 8 * _HEADER_LEN
# A step's tensors up to this many bytes ride in the header's broadcast, one collective a forward (a decode step's
# ids and metadata at batch 32 take about 2 KB); larger ones follow in a second broadcast. On gloo (the 2-core CPU)
# the header and a 2 KB buffer took 470-520 us as two broadcasts, 270-300 us as one of 8.6 KB, 310-350 us of 64 KB.
_INLINE_BYTES = 16 << 10
_MODEL_INPUTS = ("aux_layers", "hidden_states")  # what a runner's model_inputs may carry

_RUNNERS: weakref.WeakValueDictionary[int, "ModelRunner"] = weakref.WeakValueDictionary()
_runner_ids = itertools.count()


def register_runner(runner: "ModelRunner") -> int:
    """A tensor-parallel runner's id: runners are created in the same order on every rank, so ids agree."""
    runner_id = next(_runner_ids)
    _RUNNERS[runner_id] = runner
    return runner_id


def broadcast_step(tp: TPGroup, runner_id: int, input_ids: torch.Tensor, meta: PageMetadata,
                   logits_indices: torch.Tensor | None, model_inputs: dict) -> None:
    """Rank 0: send one step to the other ranks as a header (sizes and dtypes) and the tensors' bytes, in one
    broadcast (`_INLINE_BYTES`), or the header's and then one of the bytes."""
    if tp.rank != 0:
        raise RuntimeError(f"rank {tp.rank} runs rank 0's steps from serve_forever(); only rank 0 calls ModelRunner.run")
    unknown = sorted(set(model_inputs) - set(_MODEL_INPUTS))
    if unknown:
        raise ValueError(f"tensor-parallel steps carry model inputs {_MODEL_INPUTS}, not {unknown}")
    aux = model_inputs.get("aux_layers")
    tensors = [input_ids, logits_indices, model_inputs.get("hidden_states"),
               None if aux is None else torch.tensor(list(aux), dtype=torch.long, device=input_ids.device),
               *(getattr(meta, name) for name in _META_TENSORS)]
    header = [_STEP, runner_id, *(getattr(meta, name) for name in _META_INTS)]
    chunks = []
    for tensor in tensors:
        if tensor is None:
            header += [-1, 0, 0]
            continue
        if tensor.dim() > 2:
            raise ValueError(f"tensor-parallel steps carry 1-D and 2-D tensors, got shape {tuple(tensor.shape)}")
        header += [_DTYPES.index(tensor.dtype), tensor.shape[0], tensor.shape[1] if tensor.dim() == 2 else -1]
        data = tensor.contiguous().view(-1).view(torch.uint8)
        chunks += [data, data.new_zeros(-data.numel() % 8)]  # 8-byte aligned, so every field views in place
    payload = sum(chunk.numel() for chunk in chunks)
    if payload <= _INLINE_BYTES:
        tp.broadcast(_message(header, input_ids.device, chunks))
    else:
        tp.broadcast(_message(header, input_ids.device))
        tp.broadcast(torch.cat(chunks))


def _message(header: list[int], device: torch.device, chunks: Sequence[torch.Tensor] = ()) -> torch.Tensor:
    """[_HEADER_BYTES + _INLINE_BYTES] bytes: the header's int64s, then the inlined tensors' bytes (or zeros)."""
    head = torch.tensor(header + [0] * (_HEADER_LEN - len(header)), dtype=torch.long, device=device).view(torch.uint8)
    pad = _INLINE_BYTES - sum(chunk.numel() for chunk in chunks)
    return torch.cat((head, *chunks, head.new_zeros(pad)))


def receive_step(tp: TPGroup) -> tuple | None:
    """Ranks > 0: the next step as (runner id, input_ids, meta, logits_indices, model_inputs); None on stop."""
    message = tp.broadcast(torch.empty(_HEADER_BYTES + _INLINE_BYTES, dtype=torch.uint8, device=tp.device))
    header = message[:_HEADER_BYTES].view(torch.long).tolist()
    if header[0] == _STOP:
        return None
    runner_id, ints = header[1], header[2 : 2 + len(_META_INTS)]
    specs = header[2 + len(_META_INTS) :]
    shapes = []
    for i in range(4 + len(_META_TENSORS)):
        code, rows, cols = specs[3 * i : 3 * i + 3]
        shapes.append(None if code < 0 else (_DTYPES[code], (rows,) if cols < 0 else (rows, cols)))
    sizes = [0 if s is None else -(-torch.Size(s[1]).numel() * s[0].itemsize // 8) * 8 for s in shapes]
    payload = sum(sizes)
    if payload <= _INLINE_BYTES:
        buffer = message[_HEADER_BYTES : _HEADER_BYTES + payload]
    else:
        buffer = tp.broadcast(torch.empty(payload, dtype=torch.uint8, device=tp.device))
    tensors, offset = [], 0
    for shape, size in zip(shapes, sizes):
        if shape is None:
            tensors.append(None)
            continue
        dtype, dims = shape
        nbytes = torch.Size(dims).numel() * dtype.itemsize
        tensors.append(buffer[offset : offset + nbytes].view(dtype).view(dims))
        offset += size
    input_ids, logits_indices, hidden_states, aux, *meta_tensors = tensors
    meta = PageMetadata(**dict(zip(_META_TENSORS, meta_tensors)), **dict(zip(_META_INTS, ints)))
    model_inputs = {} if hidden_states is None else {"hidden_states": hidden_states}
    if aux is not None:
        model_inputs["aux_layers"] = tuple(aux.tolist())
    return runner_id, input_ids, meta, logits_indices, model_inputs


@torch.inference_mode()
def serve_forever(tp: TPGroup | None = None) -> None:
    """Ranks > 0: run each step rank 0 broadcasts on this rank's runner of the same id, until it stops them."""
    tp = tp or current()
    while (step := receive_step(tp)) is not None:
        runner_id, input_ids, meta, logits_indices, model_inputs = step
        runner = _RUNNERS.get(runner_id)
        if runner is None:
            raise RuntimeError(f"rank {tp.rank} has no runner {runner_id}: every rank must build the same "
                               "tensor-parallel models and runners in the same order")
        runner.forward(input_ids, meta, logits_indices, **model_inputs)


def on_rank0(fn: Callable[[], T], tp: TPGroup | None = None) -> T | None:
    """Rank 0 runs fn while the other ranks serve its steps; all return when it is done (fn's result on rank 0,
    None elsewhere). Every rank builds the same models and runners before the call, and fn builds none."""
    tp = tp or current()
    if tp.rank > 0:
        serve_forever(tp)
        return None
    result = fn()
    stop_workers(tp)
    return result


def stop_workers(tp: TPGroup | None = None) -> None:
    """Rank 0: let the other ranks' serve_forever return (they may then build more models and serve again)."""
    tp = tp or current()
    if tp.size > 1 and tp.rank == 0:
        tp.broadcast(_message([_STOP], tp.device))


def one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


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


# --- processes without torchrun (tests, reports) ---------------------------------------------------------------


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
