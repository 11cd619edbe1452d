"""Layers split as in Megatron-LM over a `TPGroup`: column- and row-parallel projections, the vocabulary-parallel
embedding and lm_head, and what a model asks of its shards."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.parallel.group import ShardingError, TPGroup, divisors


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
