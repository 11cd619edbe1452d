"""Micro batches from precomputed features, and the anchors each unrolls (mtp_train.unroll plans the unroll).

A micro batch packs `micro_batch_size` records (each cut to `seq_len` tokens) back to back, then one loss-masked
padding sequence up to a multiple of `trainer.pad_tokens_to` tokens (`pad_tokens`). Its n-th micro batch on a rank
is a pure function of (seed, n): epoch n // per_epoch of an `EpochSampler`, slice n % per_epoch of every rank's
order, dealt among the ranks by tokens (`deal_by_tokens`). The trainer asks for micro batch step * grad_accum + a,
so a resumed run, which knows only its step count, reads exactly the records the uninterrupted run would have read.

With `loss.chain_share` below 1, steps 1..K-1 run over a window of each record's anchors (`chain_windows`: that share
of the anchors that reach every step, from a random anchor on, wrapping around to anchor 0), step 0 over all: every
anchor is unrolled with that probability, so the later steps' loss is the same expectation from fewer samples, and
a step costs about 1 + (K-1) * share step-0 forwards instead of K, on every record and so on every rank. The
window's queries see the step-0 keys of all anchors before theirs, as in the full unroll (mtp_train.ttt).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from data_tools.conversations import DataError
from data_tools.features import EpochSampler, FeatureDataset, verify_shards
from mtp_train import distributed


class FeatureError(ValueError):
    """Features that cannot train this head; the message names the folder and the mismatch."""


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [T] the records' tokens, concatenated
    hidden_states: torch.Tensor  # [T, H] the target's pre-norm last-layer states
    loss_mask: torch.Tensor  # [T] bool
    seq_lens: list[int]
    record_ids: list[int]  # dataset indices, for logging the data order
    aux_hidden_states: torch.Tensor | None = None  # [T, n, H] the target layers an EAGLE-3 head fuses, in its order
    # per sequence (seq_lens' order): the anchors unrolled past step 0, (first, count) around 0..n-1 where n anchors
    # reach every step (`window_segments`); None: every anchor
    chain_windows: list[tuple[int, int]] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def record_tokens(self) -> int:
        """The records' tokens, without the padding sequence `pad_tokens` may add after them."""
        return sum(self.seq_lens[: len(self.record_ids)])

    def to(self, device: torch.device, dtype: torch.dtype) -> "PackedBatch":
        aux = None if self.aux_hidden_states is None else self.aux_hidden_states.to(device, dtype)
        return PackedBatch(self.input_ids.to(device), self.hidden_states.to(device, dtype), self.loss_mask.to(device),
                           self.seq_lens, self.record_ids, aux, self.chain_windows)


def anchors_reaching_every_step(length: int, num_steps: int) -> int:
    """The n anchors 0..n-1 of a record that reach every unroll step: anchor i's last step reads token i + num_steps."""
    return max(length - num_steps, 0)


def window_segments(window: tuple[int, int], n: int) -> list[tuple[int, int]]:
    """A window (first anchor, count) around anchors 0..n-1 as runs [start, end): one, or two where it wraps."""
    first, count = window[0], min(window[1], n)
    if count <= 0:
        return []
    if first + count <= n:
        return [(first, first + count)]
    return [(first, n), (0, first + count - n)]


def open_features(path: str | Path, hidden_size: int, aux_layers: tuple[int, ...] = ()) -> FeatureDataset:
    """The features with the aux layers a head reads (infer's layer indices, in the head's order), every shard
    checked against the manifest before training reads it (size, header, sha256).

    Every rank reads records of every shard, so every shard is hashed once per run on each node: the node's
    LOCAL_WORLD_SIZE processes (torchrun's; a plain run is a node of one) hash every LOCAL_WORLD_SIZE-th shard
    each and all ranks gather the problems found. Once per node rather than once per job, so node-local copies
    of features_dir are covered too; the cost per rank is the dataset's bytes / LOCAL_WORLD_SIZE at sha256's speed
    (docs/benchmark_history.md, "Figures moved out of the code"). Any problem is a one-line FeatureError naming the
    shard, raised on every rank alike.
    """
    path = Path(path)
    if not (path / "manifest.json").is_file():
        raise FeatureError(f"features_dir={path}: no manifest.json (run python -m data_tools.precompute first)")

    def check(root: Path, manifest: dict) -> None:  # the cheap mismatches first, then the shards
        stored = int(manifest["hidden_size"])
        if stored != hidden_size:
            raise FeatureError(
                f"{root}: features have hidden size {stored} but the target has {hidden_size}: they were "
                f"precomputed for another model ({manifest.get('model', {}).get('path')})"
            )
        stored_aux = manifest.get("aux_layers", [])
        missing = [layer for layer in aux_layers if layer not in stored_aux]
        if missing:
            raise FeatureError(f"{root}: the head reads target layers {list(aux_layers)} (infer aux indices), the "
                               f"features hold {stored_aux}: precompute with the same head=... "
                               "(or precompute.aux_layers)")
        part, parts = distributed.local_part()
        verify_shards(root, manifest, part, parts, gather=distributed.all_gather_lists)

    try:
        return FeatureDataset(path, list(aux_layers), verify=check)
    except DataError as err:
        raise FeatureError(str(err)) from err


def split_records(num_records: int, eval_records: int, seed: int) -> tuple[list[int], list[int]]:
    """A held-out split fixed by the seed: (train indices, eval indices), both sorted."""
    if not 0 <= eval_records < num_records:
        raise FeatureError(f"data.eval_records={eval_records} must be in [0, {num_records}) for {num_records} records")
    order = torch.randperm(num_records, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[eval_records:]), sorted(order[:eval_records])


def reaching_every_step(dataset: FeatureDataset, indices: list[int], num_steps: int) -> list[int]:
    """The records with an anchor that reaches every unroll step: num_steps + 1 tokens or more.

    Why: a micro batch with no such record runs fewer head forwards than `num_steps` (`mtp_train.unroll.unroll_plan` stops where no
    record has a position left, and a chain window holds only anchors that reach every step), and under ZeRO-3 every
    forward gathers the head's parameters with a collective: a rank that stops early leaves the others waiting for
    ever. Such records train at most num_steps - 1 positions at step 0."""
    return [i for i in indices if anchors_reaching_every_step(dataset.num_tokens(i), num_steps) > 0]


def collate(dataset: FeatureDataset, record_ids: list[int], seq_len: int, pad_to: int = 1) -> PackedBatch:
    """The records packed, cut to seq_len each; then padded to a multiple of pad_to tokens (`pad_tokens`)."""
    items = [dataset[i] for i in record_ids]
    return pad_tokens(PackedBatch(
        input_ids=torch.cat([x["input_ids"][:seq_len] for x in items]),
        hidden_states=torch.cat([x["hidden_states"][:seq_len] for x in items]),
        loss_mask=torch.cat([x["loss_mask"][:seq_len] for x in items]),
        seq_lens=[min(len(x["input_ids"]), seq_len) for x in items],
        record_ids=list(record_ids),
        aux_hidden_states=torch.cat([x["aux_hidden_states"][:seq_len] for x in items]) if dataset.aux_layers else None,
    ), pad_to)


def pad_tokens(batch: PackedBatch, multiple: int) -> PackedBatch:
    """One more sequence, of zeros and never trained (loss_mask False; not in record_ids), that takes the batch to a
    multiple of `multiple` tokens.

    Why: a step's activations are allocated at the batch's token count, and a count new at every step fragments
    glibc's heap, which then grows and slows every step (docs/benchmark_history.md, "Figures moved out of the code")."""
    extra = -batch.num_tokens % multiple
    if extra == 0:
        return batch
    pad = lambda t: torch.cat((t, t.new_zeros(extra, *t.shape[1:])))  # noqa: E731
    aux = None if batch.aux_hidden_states is None else pad(batch.aux_hidden_states)
    return PackedBatch(pad(batch.input_ids), pad(batch.hidden_states), pad(batch.loss_mask), batch.seq_lens + [extra],
                       batch.record_ids, aux, batch.chain_windows + [(0, 0)] if batch.chain_windows else None)


def draw_chain_windows(batch: PackedBatch, share: float, rng: random.Random, num_steps: int) -> PackedBatch:
    """The batch with `chain_windows`: for each record whose n = L - num_steps anchors reach every step, round(share *
    n) of them (at least one) from a random first anchor, around; none of the padding sequence. Every anchor is in
    with probability about `share`, and every record unrolls that share, so every rank does. share 1 keeps None."""
    if share >= 1:
        return batch
    windows = []
    for r, length in enumerate(batch.seq_lens):
        n = anchors_reaching_every_step(length, num_steps)
        if r >= len(batch.record_ids) or n == 0:
            windows.append((0, 0))
        else:
            windows.append((rng.randrange(n), max(1, round(share * n))))
    return replace(batch, chain_windows=windows)


def deal_by_tokens(shares: list[list[int]], num_tokens: Callable[[int], int]) -> list[list[int]]:
    """One global micro batch dealt again: each rank keeps as many records as its round-robin share, and the ranks'
    token counts come out as even as greedy gets (longest record first, each to the rank with the fewest tokens that
    still has room; ties to the lowest rank). A pure function of the shares, so every rank deals alike.

    Why: data-parallel ranks wait at every step for the one with the most tokens; dealt, the heaviest rank sits far
    closer to the mean than under round robin (docs/benchmark_history.md, "Figures moved out of the code")."""
    flat = [record for share in shares for record in share]
    tokens = [num_tokens(record) for record in flat]
    sizes = [len(share) for share in shares]
    dealt: list[list[int]] = [[] for _ in shares]  # positions in `flat`, per rank
    load = [0] * len(shares)
    for p in sorted(range(len(flat)), key=lambda p: (-tokens[p], p)):  # longest first
        rank = min((r for r in range(len(shares)) if len(dealt[r]) < sizes[r]), key=lambda r: (load[r], r))
        dealt[rank].append(p)
        load[rank] += tokens[p]
    return [[flat[p] for p in sorted(mine)] for mine in dealt]


class MicroBatches:
    """This rank's n-th training micro batch, for any n (epochs follow one another, each reshuffled): the ranks'
    n-th round-robin shares of the epoch's order, dealt by tokens (`deal_by_tokens`); its chain windows
    (`draw_chain_windows`) drawn by a generator seeded with (seed, n, rank)."""

    def __init__(self, dataset: FeatureDataset, indices: list[int], micro_batch_size: int, seq_len: int, seed: int,
                 rank: int, world_size: int, pad_to: int = 1, chain_share: float = 1.0, num_steps: int = 1) -> None:
        self.dataset, self.indices, self.pad_to, self.rank = dataset, indices, pad_to, rank
        self.seed, self.chain_share, self.num_steps = seed, chain_share, num_steps
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.samplers = [EpochSampler(len(indices), seed=seed, rank=r, world_size=world_size, drop_last=True)
                         for r in range(world_size)]
        self.per_epoch = len(self.samplers[0]) // micro_batch_size
        if self.per_epoch < 1:
            raise FeatureError(f"{len(indices)} training records cannot give each of {world_size} ranks a micro batch "
                               f"of {micro_batch_size}")
        self._epoch, self._orders = -1, []

    def __call__(self, n: int) -> PackedBatch:
        epoch, j = divmod(n, self.per_epoch)
        if epoch != self._epoch:
            for sampler in self.samplers:
                sampler.set_epoch(epoch)
            self._epoch, self._orders = epoch, [list(sampler) for sampler in self.samplers]
        size = self.micro_batch_size
        shares = [[self.indices[i] for i in order[j * size : (j + 1) * size]] for order in self._orders]
        tokens = lambda i: min(self.dataset.num_tokens(i), self.seq_len)  # noqa: E731 - as collate cuts them
        dealt = deal_by_tokens(shares, tokens) if len(shares) > 1 else shares
        prepare = getattr(self.dataset, "prepare", None)  # features=online: the target computes the ranks' records
        if prepare is not None:
            prepare(dealt)
        mine = dealt[self.rank]
        batch = collate(self.dataset, mine, self.seq_len, self.pad_to)
        return draw_chain_windows(batch, self.chain_share, random.Random(f"{self.seed}:{n}:{self.rank}"),
                                  self.num_steps)


def eval_batches(dataset: FeatureDataset, indices: list[int], micro_batch_size: int, seq_len: int, rank: int,
                 world_size: int) -> list[PackedBatch]:
    """This rank's share of the held-out records (equal counts on every rank: a few records may repeat)."""
    if not indices:
        return []
    sampler = EpochSampler(len(indices), rank=rank, world_size=world_size, shuffle=False)
    mine = [indices[i] for i in sampler]
    return [collate(dataset, mine[s : s + micro_batch_size], seq_len) for s in range(0, len(mine), micro_batch_size)]
