"""Training micro batches across data-parallel ranks (mtp_train.data.MicroBatches, deal_by_tokens).

What a user relies on: every rank's step holds the same records a one-process run of the same global batch would
(so the runs train alike), each record once per epoch, the same records again after a resume; and the ranks' token
counts close enough that no rank waits long for another. Control: the round-robin shares the dealing starts from
are measurably less even on the same records. With loss.chain_share below 1, the records unrolled past step 0 hold
about that share of a batch's tokens, are drawn anew for every batch (each record's chance near the share), never
include the padding, and come back the same after a resume.
"""

from __future__ import annotations

import random
import statistics

import torch

from mtp_train.data import MicroBatches, deal_by_tokens, reaching_every_step
from mtp_train.unroll import step_token_counts, unroll_plan


class LengthsOnly:
    """A feature dataset of given record lengths (zeros for the tensors)."""

    aux_layers: list[int] = []

    def __init__(self, lengths: list[int]) -> None:
        self.lengths = lengths

    def num_tokens(self, index: int) -> int:
        return self.lengths[index]

    def __getitem__(self, index: int) -> dict:
        n = self.lengths[index]
        return {"input_ids": torch.full((n,), index), "loss_mask": torch.ones(n, dtype=torch.bool),
                "hidden_states": torch.zeros(n, 4)}


def test_dealing_keeps_each_ranks_count_and_evens_out_its_tokens():
    rng = random.Random(0)
    worst_dealt, worst_round_robin = [], []
    for _ in range(200):
        lengths = {i: rng.randint(20, 2000) for i in range(64)}  # chat-like spread
        shares = [list(range(r * 8, (r + 1) * 8)) for r in range(8)]  # 8 ranks x 8 records
        dealt = deal_by_tokens(shares, lengths.__getitem__)
        assert [len(d) for d in dealt] == [8] * 8 and sorted(sum(dealt, [])) == list(range(64))
        mean = sum(lengths.values()) / 8
        worst_dealt.append(max(sum(lengths[i] for i in d) for d in dealt) / mean)
        worst_round_robin.append(max(sum(lengths[i] for i in s) for s in shares) / mean)
    assert statistics.mean(worst_dealt) < 1.02  # the heaviest rank within 2% of the mean
    assert statistics.mean(worst_round_robin) > 1.15  # control: the shares it starts from


def test_ranks_read_the_one_process_records_once_an_epoch_and_again_after_a_resume():
    rng = random.Random(1)
    dataset = LengthsOnly([rng.randint(5, 300) for _ in range(101)])
    indices = list(range(3, 101))  # 98 training records: 24 micro batches of 2 per rank and epoch at 2 ranks
    one = MicroBatches(dataset, indices, 2, seq_len=256, seed=7, rank=0, world_size=1)
    ranks = [MicroBatches(dataset, indices, 2, seq_len=256, seed=7, rank=r, world_size=2) for r in range(2)]
    assert ranks[0].per_epoch == 24
    seen = []
    for n in range(ranks[0].per_epoch):
        step = [b.record_ids for b in (ranks[0](n), ranks[1](n))]
        assert all(len(ids) == 2 for ids in step)
        # the global batch of step n is the one process's micro batches 2n and 2n+1 (grad_accum 2)
        assert sorted(step[0] + step[1]) == sorted(one(2 * n).record_ids + one(2 * n + 1).record_ids)
        seen += step[0] + step[1]
    assert len(seen) == len(set(seen)) == 96  # each record at most once an epoch (98 cut to 2 x 48)
    resumed = MicroBatches(dataset, indices, 2, seq_len=256, seed=7, rank=1, world_size=2)
    assert resumed(30).record_ids == ranks[1](30).record_ids  # epoch 1, as the uninterrupted run reads it
    batch = ranks[0](5)
    assert batch.input_ids[: batch.record_tokens].unique().tolist() == sorted(batch.record_ids)


def test_chain_windows_unroll_each_anchor_with_the_share_and_come_back_after_a_resume():
    rng = random.Random(2)
    dataset = LengthsOnly([rng.randint(75, 388) for _ in range(400)] + [3, 4, 5])  # the pipeline's stories, and short
    batches = lambda seed=3, rank=0, world=1, share=0.3: MicroBatches(  # noqa: E731
        dataset, list(range(403)), 16, seq_len=512, seed=seed, rank=rank, world_size=world, pad_to=256,
        chain_share=share, num_steps=4)
    picked = {}  # (record, anchor) -> times in a window, per record the times it was drawn
    drawn = {}
    for rank, world in ((0, 1), (0, 2), (1, 2)):
        mine = batches(rank=rank, world=world)
        for n in range(80):
            batch = mine(n)
            assert len(batch.chain_windows) == len(batch.seq_lens)
            unrolled = 0
            for r, (length, (first, count)) in enumerate(zip(batch.seq_lens, batch.chain_windows)):
                reach = length - 4  # anchors that reach every step
                if r >= len(batch.record_ids) or reach <= 0:  # the padding, and records too short
                    assert count == 0
                    continue
                assert count == max(1, round(0.3 * reach)) and 0 <= first < reach  # every record its share
                unrolled += count
                record = batch.record_ids[r]
                drawn[record] = drawn.get(record, 0) + 1
                for a in range(first, first + count):
                    picked[(record, a % reach)] = picked.get((record, a % reach), 0) + 1
            steps = unroll_plan(batch.seq_lens, 4, chain_windows=batch.chain_windows)
            assert len(steps) == 4 and all(sum(step.seq_lens) == unrolled for step in steps[1:])
            assert step_token_counts(batch, steps, 4)[1] == unrolled  # the loss's normalisers count just those positions
    # every anchor, first and last included, is unrolled about as often as the share says
    edges, middles = [], []
    for (record, a), times in picked.items():
        reach = dataset.lengths[record] - 4
        (edges if a in (0, reach - 1) else middles).append(times / drawn[record])
    assert abs(statistics.mean(edges) - 0.3) < 0.05 and abs(statistics.mean(middles) - 0.3) < 0.02
    one = batches()
    assert batches()(57).chain_windows == one(57).chain_windows  # a resumed run draws the same
    assert batches(seed=4)(57).chain_windows != one(57).chain_windows
    assert batches(share=1.0)(0).chain_windows is None  # every anchor, as before


def test_every_micro_batch_of_the_kept_records_runs_every_unroll_step():
    """Under ZeRO-3 every head forward is a collective: a rank whose micro batch stops its unroll early leaves the
    others waiting (a two-process run with a few 4-token records and chain_share=0.5 hung). The trainer keeps the
    records that reach every step (`reaching_every_step`); control: one record a micro batch over every record stops
    early on the short ones."""
    dataset = LengthsOnly([90, 5, 4, 3, 120, 5, 2, 77])
    kept = reaching_every_step(dataset, list(range(8)), 4)
    assert kept == [0, 1, 4, 5, 7]

    def step_counts(indices: list[int], share: float) -> set[int]:
        batches = MicroBatches(dataset, indices, 1, seq_len=512, seed=0, rank=0, world_size=1, pad_to=256,
                               chain_share=share, num_steps=4)
        return {len(unroll_plan(b.seq_lens, 4, chain_windows=b.chain_windows)) for b in map(batches, range(20))}

    for share in (1.0, 0.5, 0.1):
        assert step_counts(kept, share) == {4}
    assert step_counts(list(range(8)), 0.5) != {4}  # the short records alone: fewer forwards on that rank
