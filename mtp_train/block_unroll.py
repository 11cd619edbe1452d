"""The block head's training forward (infer.models.block_head): many blocks a record, against the record's context.

Record of L tokens t_0..t_{L-1} with stored target states; an anchor a (1 <= a <= L-2) is a block whose pending
token is t_a at position a:
    context        the head's context keys/values at positions 0..a-1 (strictly before the anchor), projected once a
                   record from the fused target layers, as the runtime's catch-up does
    block rows     t_a's embedding, then B-1 mask rows, at positions a..a+B-1 (one forward for every anchor)
    targets        row k (k = 1..B-1, position a+k) learns the target's distribution of t_{a+k}: softmax(lm_head(
                   norm(h_{a+k-1}))), and its argmax
    trained when   a+k <= L-1 and loss_mask[a+k] (the token is an assistant / generated one)
Anchors: `anchors_per_record` distinct ones a record, drawn from a generator seeded by the record's id and
`seed` (the same anchors whatever the batch split, so a resumed run draws what the uninterrupted one did);
`anchor_plan` takes explicit anchors too (the replay: the runtime's verify positions).

    loss = sum_k w_k / N_k * sum_{anchors} mask (w_kl KL + w_ce CE + w_tv TV),   w_k = exp(-(k-1) / gamma)

(gamma <= 0: w_k = 1.), or with position_weight="dpace" D-PACE's per-block weights (arXiv 2605.18810; vLLM
speculators' default for dflash, `dpace_weights`). N_k, the trained rows at block position k over the global batch,
is the trainer's normaliser, as the unrolled heads' (mtp_train.unroll). Stats columns are mtp_train.unroll.STATS
with `reached`: block rows whose earlier rows all agreed with the target's argmax (the runtime's verify reaches
them), so reached_top1 / reached is the conditional acceptance at block position k. The block positions take the
place of the unroll steps in every report (k-th "step" = draft position k+1).

Per-position weights: the exp(-(k-1)/gamma) decay of the DFlash paper (arXiv 2602.06036, its eq. for the
position-weighted CE), or D-PACE (arXiv 2605.18810) as speculators 0.9.0 computes it (speculators/losses/utils.py
`dpace_loss_decay`, models/dflash/metrics.py): block n's row k gets w_nk = sum_{m>=k} prod_{j<=m} s_nj over its trained
rows, s_nj = (1 - alpha) q_nj + alpha, q_nj the draft's probability of the target's greedy token (exp(-CE), detached):
the gradient of the block's expected accepted length with respect to log q_nk, smoothed. Unlike speculators (which
requires loss CE alone) the weights multiply whatever KL/CE/TV mix the head trains with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.common import RMSNorm
from infer.models.block_head import BlockHead
from mtp_train.data import PackedBatch
from mtp_train.losses import distill_loss, target_distribution
from mtp_train.unroll import STATS, LossWeights, per_step_means, replay_report, verify_walk


@dataclass
class BlockPlan:
    """Per record of the batch: its offset in the packed batch, length, and anchors."""

    offsets: list[int]
    lengths: list[int]
    anchors: list[torch.Tensor]  # [n_r] long


def sample_anchors(length: int, count: int, record_id: int, seed: int) -> torch.Tensor:
    """`count` distinct anchors in 1..length-2 (all of them if fewer), sorted; seeded by record and seed."""
    candidates = max(length - 2, 0)
    if candidates == 0:
        return torch.empty(0, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + int(record_id))
    chosen = torch.randperm(candidates, generator=gen)[:count] + 1
    return chosen.sort().values


def anchor_plan(batch: PackedBatch, anchors_per_record: int, seed: int = 0,
                anchors: list[torch.Tensor] | None = None) -> BlockPlan:
    offsets, lengths = [], []
    start = 0
    for length in batch.seq_lens:
        offsets.append(start)
        lengths.append(length)
        start += length
    if anchors is None:
        ids = list(batch.record_ids) + [None] * (len(lengths) - len(batch.record_ids))  # a padding sequence: none
        anchors = [sample_anchors(n, anchors_per_record, rid, seed) if rid is not None else torch.empty(0).long()
                   for n, rid in zip(lengths, ids)]
    return BlockPlan(offsets, lengths, [a.long().cpu() for a in anchors])


def block_rows(plan: BlockPlan, block_size: int, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([N, B-1] the packed row of each block row's target distribution (h_{a+k-1}), [N, B-1] its weight)."""
    k = torch.arange(1, block_size)
    rows, weights = [], []
    for offset, length, anchors in zip(plan.offsets, plan.lengths, plan.anchors):
        pos = anchors[:, None] + k[None, :]  # [n, B-1] a+k
        inside = pos <= length - 1
        packed = offset + pos.clamp(max=length - 1)
        rows.append(packed - 1)
        weights.append(inside & loss_mask.cpu()[packed].bool())
    if not rows:
        return torch.empty(0, block_size - 1, dtype=torch.long), torch.empty(0, block_size - 1, dtype=torch.bool)
    return torch.cat(rows), torch.cat(weights)


def block_token_counts(batch: PackedBatch, plan: BlockPlan, block_size: int) -> torch.Tensor:
    """[B-1] trained rows per block position (the loss's normaliser)."""
    return block_rows(plan, block_size, batch.loss_mask)[1].sum(0).float()


def block_outputs(head: BlockHead, batch: PackedBatch, plan: BlockPlan) -> torch.Tensor:
    """[N, B, H] every anchor's block output (before final_norm), records in order: the context keys/values are
    projected once for the packed batch, then each block gathers its record's positions before its anchor (as the
    runtime gathers its pages)."""
    device = batch.input_ids.device
    starts = [torch.full((a.numel(),), o, dtype=torch.long) for o, a in zip(plan.offsets, plan.anchors)]
    if not starts or sum(s.numel() for s in starts) == 0:
        return batch.hidden_states.new_zeros(0, head.block_size, head.config.hidden_size)
    offsets, anchors = torch.cat(starts).to(device), torch.cat(plan.anchors).to(device)  # [N]
    positions = torch.cat([torch.arange(n) for n in batch.seq_lens]).to(device)  # [T] within each record
    features = head.features(batch.hidden_states, batch.aux_hidden_states)  # [T, H] c_j
    context_kv = head.context_kv(features, positions)
    pos = torch.arange(int(anchors.max()), device=device)
    valid = pos[None, :] < anchors[:, None]  # [N, L] strictly before the anchor
    rows = torch.where(valid, offsets[:, None] + pos[None, :], 0)
    block_pos = anchors[:, None] + torch.arange(head.block_size, device=device)
    anchor_features = features[offsets + anchors - 1] if head.config.anchor_input else None  # c_{a-1}
    x = head.block_inputs(batch.input_ids[offsets + anchors], None, anchor_features)
    return head.block_hidden(x, block_pos, [kv[rows] for kv in context_kv], valid)


def position_weights(block_size: int, gamma: float) -> list[float]:
    """exp(-(k-1)/gamma) for k = 1..B-1 (1 each where gamma <= 0)."""
    return [math.exp(-(k - 1) / gamma) if gamma > 0 else 1.0 for k in range(1, block_size)]


POSITION_WEIGHTS = ("exp_decay", "dpace")


def dpace_weights(confidence: torch.Tensor, trained: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weights [N, B-1] from each row's draft confidence q [N, B-1] and trained mask: the smoothed prefix
    products s = (1 - alpha) q + alpha (1 where untrained), summed from each trained row to the block's end."""
    if not 0.0 < alpha <= 1.0:
        raise ValueError(f"head.dpace_alpha={alpha} must be in (0, 1]")
    mask = trained.to(confidence.dtype)
    smooth = torch.where(trained, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
    prefix = smooth.cumprod(-1) * mask
    return prefix.flip(-1).cumsum(-1).flip(-1) * mask


@torch.no_grad()
def greedy_confidence(hidden: torch.Tensor, lm_head_weight: torch.Tensor, greedy: torch.Tensor,
                      chunk: int) -> torch.Tensor:
    """hidden [N, K, H] (after final_norm), greedy [N, K] the target's greedy draft index (-1: outside the draft
    vocabulary) -> [N, K] fp32 the draft's probability of it (0 outside), [chunk, vocab] logits at a time."""
    flat, ids = hidden.flatten(0, 1), greedy.flatten()
    out = torch.zeros(ids.shape[0], dtype=torch.float32, device=hidden.device)
    for start in range(0, ids.shape[0], chunk):
        end = min(start + chunk, ids.shape[0])
        log_q = torch.log_softmax(F.linear(flat[start:end].float(), lm_head_weight.float()), dim=-1)
        picked = log_q.gather(1, ids[start:end].clamp(min=0)[:, None])[:, 0].exp()
        out[start:end] = torch.where(ids[start:end] >= 0, picked, 0.0)
    return out.view(greedy.shape)


class BlockObjective(nn.Module):
    """The module DeepSpeed wraps for a block head (its only submodule: the head), as mtp_train.unroll.UnrolledHead
    for the others; `num_steps` = B-1 block positions."""

    def __init__(self, head: BlockHead, norm_weight: torch.Tensor, eps: float, weights: LossWeights,
                 anchors_per_record: int, gamma: float, seed: int = 0, position_weight: str = "exp_decay",
                 dpace_alpha: float = 0.5) -> None:
        super().__init__()
        self.head = head
        norm = RMSNorm(norm_weight.shape[0], eps)
        norm.weight = nn.Parameter(norm_weight, requires_grad=False)
        self.__dict__["target_norm"] = norm  # frozen, not a submodule
        self.num_steps = head.block_size - 1
        self.weights, self.anchors_per_record, self.seed = weights, anchors_per_record, seed
        self.position_weights = position_weights(head.block_size, gamma)
        if position_weight not in POSITION_WEIGHTS:
            raise ValueError(f"head.position_weight={position_weight!r} must be one of {', '.join(POSITION_WEIGHTS)}")
        if position_weight == "dpace":
            dpace_weights(torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool), dpace_alpha)  # alpha checked now
        self.position_weight, self.dpace_alpha = position_weight, dpace_alpha

    def plan(self, batch: PackedBatch) -> BlockPlan:
        return anchor_plan(batch, self.anchors_per_record, self.seed)

    def counts(self, batch: PackedBatch, plan: BlockPlan) -> torch.Tensor:
        return block_token_counts(batch, plan, self.head.block_size)

    def forward(self, batch: PackedBatch, normalisers: torch.Tensor, plan: BlockPlan | None = None,
                return_agreement: bool = False) -> tuple:
        """(loss, stats [B-1, len(STATS)]), and with return_agreement the per-position agreement [N] bool."""
        head, w = self.head, self.weights
        plan = self.plan(batch) if plan is None else plan
        device = batch.input_ids.device
        target = target_distribution(batch.hidden_states, self.target_norm, head.shared.lm_head, None,
                                     w.chunk_tokens)
        rows, trained = block_rows(plan, head.block_size, batch.loss_mask)
        rows, trained = rows.to(device), trained.to(device)
        hidden = head.final_norm(block_outputs(head, batch, plan))  # [N, B, H]
        lm_head_weight = head.lm_head_weight()
        stats = torch.zeros(self.num_steps, len(STATS), device=device)
        loss = torch.zeros((), device=device)
        chain = torch.ones(rows.shape[0], dtype=torch.bool, device=device)
        agreement = []
        row_weights = trained.float()  # [N, B-1]: exp_decay's per-position weights apply below
        if self.position_weight == "dpace":
            confidence = greedy_confidence(hidden[:, 1:], lm_head_weight, target.greedy[rows], w.chunk_tokens)
            row_weights = dpace_weights(confidence, trained, self.dpace_alpha)  # > 0 wherever trained: stats as before
        for k in range(self.num_steps):
            token_weight = row_weights[:, k]
            kl_ce, step_stats, agree = distill_loss(hidden[:, k + 1], lm_head_weight, target.rows(rows[:, k]),
                                                    token_weight, w.kl, w.ce, w.chunk_tokens, w.tv)
            reached = trained[:, k] & chain
            chain = chain & agree
            decay = self.position_weights[k] if self.position_weight == "exp_decay" else 1.0
            loss = loss + decay / normalisers[k].clamp(min=1) * kl_ce
            chained = torch.stack((reached.sum(), (reached & agree).sum())).float()
            stats[k] = torch.cat((step_stats, chained, torch.zeros(1, device=device)))
            agreement.append(agree)
        return (loss, stats, agreement) if return_agreement else (loss, stats)


@torch.no_grad()
def block_replay(objective: BlockObjective, batch: PackedBatch, prompt_lens: list[int], k: int) -> dict:
    """The trainer's conditional top-1 per draft position at the anchors a greedy runtime verifies from on these
    (greedy) texts: the first pending token after the prompt, then each accepted drafts + 1 further. On a greedy text
    the runtime's block at such an anchor reads what the trainer's does, so this is its conditional acceptance.
    Also (mtp_train.validate.trainer_replay's keys) top-1, conditional top-1 and KL over every generated anchor."""
    every = [torch.arange(n, max(length - 1, n)) for n, length in zip(prompt_lens, batch.seq_lens)]
    plan = anchor_plan(batch, 0, anchors=every)
    counts = objective.counts(batch, plan)
    _, stats, agreement = objective(batch, counts, plan, return_agreement=True)
    means = per_step_means(stats.cpu(), counts.cpu())
    agree = torch.stack(agreement, dim=1).cpu()  # [N, B-1], anchors in plan order
    reached, accepted = [0] * k, [0] * k
    row = 0
    for anchors, length in zip(plan.anchors, plan.lengths):
        at = {int(a): row + j for j, a in enumerate(anchors.tolist())}
        row += anchors.numel()
        if anchors.numel():  # a block at pending position a drafts t_{a+1}, ...
            verify_walk(lambda anchor, j, at=at: bool(agree[at[anchor], j]), int(anchors[0]), length, k, reached,
                        accepted)
    return replay_report(means, accepted, reached, int(counts[0]), k)
