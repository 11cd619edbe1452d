"""Training-side reading of precomputed features, and the target's logits recomputed from them.

`FeatureDataset` first checks every shard against the manifest (`verify_shards`), then indexes every record
of every shard from the small `record_offsets` tensors only; a record's tokens and hidden states are read on
access as slices of the memory-mapped safetensors file, so a dataset larger than RAM is fine. `EpochSampler`
gives a deterministic order per (seed, epoch) and each rank its own part of it (equal lengths on every rank,
as DeepSpeed's data-parallel steps need).

Logits are never stored: training recomputes the target's next-token distribution from the stored pre-norm hidden
states and the target's final norm and lm_head (`infer.models.common.final_logits`; mtp_train.target reads those two).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from data_tools.conversations import DataError
from data_tools.shards import aux_key, read_manifest, shard_problem


def verify_shards(root: Path, manifest: dict, part: int = 0, parts: int = 1,
                  gather: Callable[[list[str]], list[str]] = list) -> None:
    """Raise a DataError naming the first shard that is missing, truncated, unreadable or damaged.

    Every shard's presence, size and header are checked (cheap); the full sha256 (the whole cost) only for shards
    part, part + parts, ... . Processes that read the same files share
    the hashing that way: each hashes its part, and `gather` (an all-gather across them) hands every process
    every problem found, so all of them raise the same error together and none is left waiting in a collective.
    """
    problems = [problem for i, entry in enumerate(manifest["shards"])
                if (problem := shard_problem(root, entry, full_hash=i % parts == part)) is not None]
    problems = sorted(gather(problems))  # messages start with the shard's path: shard order
    if problems:
        more = f" ({len(problems) - 1} more shards fail these checks)" if len(problems) > 1 else ""
        raise DataError(problems[0] + more)


class FeatureDataset(torch.utils.data.Dataset):
    """Map-style dataset over a precompute output folder; item i is one record:

    input_ids [L] int64, loss_mask [L] bool, hidden_states [L, hidden] (stored dtype),
    aux_hidden_states [L, len(aux_layers), hidden] when aux layers are requested, source (str).
    `verify(root, manifest)` runs before any shard is read: by default every shard is checked in full.
    """

    def __init__(self, root: str | Path, aux_layers: list[int] | None = None, max_records: int | None = None,
                 verify: Callable[[Path, dict], None] = verify_shards) -> None:
        self.root = Path(root)
        self.manifest = read_manifest(self.root)
        self.aux_layers = list(aux_layers or [])
        missing = [x for x in self.aux_layers if x not in self.manifest["aux_layers"]]
        if missing:
            raise ValueError(f"{self.root}: aux layers {missing} were not precomputed (have {self.manifest['aux_layers']})")
        verify(self.root, self.manifest)
        self.files = [self.root / s["file"] for s in self.manifest["shards"]]
        shard_of, record_in_shard, spans = [], [], []
        for shard, path in enumerate(self.files):
            with safe_open(str(path), framework="pt") as f:
                record_offsets = f.get_tensor("record_offsets")  # [R + 1], small: the only tensor read up front
            num_records = record_offsets.numel() - 1
            shard_of.append(torch.full((num_records,), shard, dtype=torch.int32))
            record_in_shard.append(torch.arange(num_records, dtype=torch.int32))
            spans.append(torch.stack((record_offsets[:-1], record_offsets[1:]), dim=1))
        # Per record: its shard, its index there, and its tokens [start, end) within the shard.
        self._shard_of = torch.cat(shard_of)[:max_records]
        self._record_in_shard = torch.cat(record_in_shard)[:max_records]
        self._spans = torch.cat(spans)[:max_records]
        self._handles: dict[int, object] = {}  # safe_open handles per shard, opened lazily (per worker process)

    def __len__(self) -> int:
        return self._shard_of.numel()

    def num_tokens(self, index: int) -> int:
        start, end = self._spans[index].tolist()
        return end - start

    def _handle(self, shard: int):
        if shard not in self._handles:
            self._handles[shard] = safe_open(str(self.files[shard]), framework="pt")
        return self._handles[shard]

    def __getitem__(self, index: int) -> dict:
        shard = int(self._shard_of[index])
        start, end = self._spans[index].tolist()
        f = self._handle(shard)
        item = {
            "input_ids": f.get_slice("input_ids")[start:end].long(),
            "loss_mask": f.get_slice("loss_mask")[start:end].bool(),
            "hidden_states": f.get_slice("hidden_states")[start:end],
        }
        if self.aux_layers:
            item["aux_hidden_states"] = torch.stack(
                [f.get_slice(aux_key(layer))[start:end] for layer in self.aux_layers], dim=1
            )
        item["source"] = self.manifest["shards"][shard]["sources"][int(self._record_in_shard[index])]
        return item

    def __getstate__(self) -> dict:  # DataLoader workers reopen their own handles
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state


class EpochSampler(torch.utils.data.Sampler):
    """A permutation of the records fixed by (seed, epoch), dealt to ranks round robin.

    Every rank gets ceil(N / world) indices: the permutation is padded by wrapping (drop_last=False) or cut
    (drop_last=True) so that all ranks take the same number of steps.
    """

    def __init__(self, num_records: int, seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                 drop_last: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if num_records < 1:
            raise ValueError("the dataset is empty")
        self.num_records, self.seed, self.rank, self.world_size = num_records, seed, rank, world_size
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_records // self.world_size
        return -(-self.num_records // self.world_size)

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(self.num_records, generator=generator)
        else:
            order = torch.arange(self.num_records)
        total = len(self) * self.world_size
        if total > order.numel():
            order = torch.cat((order, order[: total - order.numel()]))
        return iter(order[:total][self.rank :: self.world_size].tolist())
