"""Rank 0's step broadcast: the wire protocol that sends one runner's step to the other ranks, and their loop."""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

import torch

from infer.kv_cache import PageMetadata
from infer.parallel.group import TPGroup, current

if TYPE_CHECKING:
    from infer.model_runner import ModelRunner

T = TypeVar("T")

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
# ids and metadata at batch 32 take about 2 KB); larger ones follow in a second broadcast. On gloo one broadcast of
# the header with the bytes inlined beats two (see docs/benchmark_history.md).
_INLINE_BYTES = 16 << 10
_MODEL_INPUTS = ("aux_layers", "hidden_states")  # what a runner's model_inputs may carry

# Every tensor-parallel runner of the process, by id. Process-wide, not per group: each CLI's main joins anew
# (init_tp makes a new group object) while runners built on an earlier group object of the same ranks are still
# served, so ids must agree across them.
_RUNNERS: weakref.WeakValueDictionary[int, ModelRunner] = weakref.WeakValueDictionary()
_runner_ids = itertools.count()


def register_runner(runner: ModelRunner) -> int:
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
