"""The training forward: the head applied K times on its own hidden states, attending as the runtime drafts.

`UnrolledHead` is the module DeepSpeed wraps. Its only registered submodule is the head, so the engine's
parameters, optimizer state and checkpoints are the head's alone; the target's frozen tensors (embedding,
lm_head, final norm) are referenced through plain attributes. `unrolled_steps` runs infer's head forward K times
with `mtp_train.ttt.ChainAttention` (training-time test: step k at anchor i sees the step-0 keys of anchors 0..i and
its own chain's keys, as the runtime's drafter does); step 0 reads the head's features of the target (MTP: h_i;
EAGLE-3: its fusion of three layers), step k > 0 the head's own output of step k - 1. The target's distribution is
computed once per micro batch (mtp_train.losses.target_distribution) and every step reads its rows; then the
chunked losses of mtp_train.losses.

    loss = sum_k step_decay^k / N_k * sum_i mask_{k,i} (w_kl KL + w_ce CE + w_tv TV + w_feature SmoothL1)

N_k (trained positions at step k over the whole global batch: all ranks and micro batches) is passed in by the
trainer, so the gradient does not depend on how the global batch is split over ranks and accumulation.

The unroll's index plan (`unroll_plan`) is built once per micro batch: the trainer counts N_k from it and passes it
to the forward.

The shift (record of L tokens t_0..t_{L-1}, stored target states h_0..h_{L-1}; h_j predicts t_{j+1}):
  unroll step k = 0..K-1, head position i = 0..L-2-k (L-1-k positions):
    token input        t_{i+1+k}
    hidden input       h_i for k = 0; the head's own output at position i of step k-1 otherwise
    position           i + k (where the runtime's drafter puts it)
    targets            the target's distribution at i+1+k (softmax(lm_head(norm(h_{i+1+k})))), its argmax,
                       and h_{i+1+k} for the feature loss
    trained when       loss_mask[i+1+k]: the token fed in is an assistant token
Step k at anchor i attends to the step-0 keys of anchors 0..i and to its own chain's keys of steps 1..k at anchor
i, as the runtime's drafter does (mtp_train.ttt); a step's anchors are a prefix of the previous step's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from torch import nn

from infer.models.common import ModelOutput, RMSNorm
from infer.models.mtp_head import DraftHead
from mtp_train.config import LossConfig
from mtp_train.data import PackedBatch, anchors_reaching_every_step, window_segments
from mtp_train.losses import distill_loss, feature_loss, target_distribution
from mtp_train.ttt import ChainAttention

# Stats columns per unroll step, sums over trained positions. reached: anchors where every earlier step agreed with
# the target (all of them at step 0), the positions the runtime's chain reaches; reached_top1: of those, this step
# agrees too. reached_top1 / reached is the trainer's conditional acceptance at draft position k + 1.
STATS = ("kl", "ce", "top1", "tv", "reached", "reached_top1", "feature")


@dataclass
class LossWeights:
    kl: float = 1.0
    ce: float = 0.0
    feature: float = 0.0
    tv: float = 0.0
    step_decay: float = 0.8  # step k weighs step_decay ** k
    chunk_tokens: int = 512

    @classmethod
    def from_config(cls, loss: LossConfig) -> "LossWeights":
        """From the `loss` node of the training config (mtp_train.config.LossConfig)."""
        return cls(kl=loss.kl, ce=loss.ce, feature=loss.feature, tv=loss.tv, step_decay=loss.step_decay,
                   chunk_tokens=loss.chunk_tokens)


@dataclass
class UnrollStep:
    token_index: torch.Tensor  # [T_k] into the packed batch: t_{i+1+k}, h_{i+1+k}, loss_mask[i+1+k]
    prev_index: torch.Tensor  # [T_k] into the previous step's hidden states (step 0: the packed h_i)
    positions: torch.Tensor  # [T_k] i + k
    seq_lens: list[int]  # per segment (a run of consecutive anchors of one record) with positions at this step
    records: list[int]  # each segment's record: its index in the batch
    starts: list[int]  # each segment's first anchor

    def to(self, device: torch.device | str) -> "UnrollStep":
        return replace(self, token_index=self.token_index.to(device), prev_index=self.prev_index.to(device),
                       positions=self.positions.to(device))


def unroll_plan(seq_lens: list[int], num_steps: int,
                chain_windows: list[tuple[int, int]] | None = None) -> list[UnrollStep]:
    """Each unroll step's index plan (the module docstring's shift): a step's rows are segments of consecutive
    anchors, one per record (anchors 0..L-2-k) or, past step 0 with chain_windows, its window's runs."""
    steps: list[UnrollStep] = []
    offsets = [sum(seq_lens[:r]) for r in range(len(seq_lens))]  # each record's first token in the packed batch
    prev_rows = {(r, 0): offsets[r] for r in range(len(seq_lens))}  # step 0 reads h_i from the packed batch
    for k in range(num_steps):
        token_index, prev_index, positions, lens, records, firsts = [], [], [], [], [], []
        rows: dict[tuple[int, int], int] = {}  # (record, first anchor) -> the segment's first row in this step
        out = 0
        for r, length in enumerate(seq_lens):
            n = length - 1 - k
            if n <= 0:
                continue
            if k == 0 or chain_windows is None:
                segments = [(0, n)]
            else:  # a window lies within the anchors that reach every step: none drops out
                segments = window_segments(chain_windows[r], anchors_reaching_every_step(length, num_steps))
            for first, end in segments:
                i = torch.arange(first, end)
                token_index.append(offsets[r] + i + 1 + k)
                # step 1 of a window reads step 0's whole-record segment; later steps the window's own segment
                prev = prev_rows[(r, first)] - first if (r, first) in prev_rows else prev_rows[(r, 0)]
                prev_index.append(prev + i)
                positions.append(i + k)
                rows[(r, first)] = out
                out += end - first
                lens.append(end - first)
                records.append(r)
                firsts.append(first)
        if not lens:
            break
        steps.append(UnrollStep(torch.cat(token_index), torch.cat(prev_index), torch.cat(positions), lens, records,
                                firsts))
        prev_rows = rows
    return steps


def batch_plan(batch: PackedBatch, num_steps: int) -> list[UnrollStep]:
    """A micro batch's plan, on the CPU (each step moves to the batch's device in `unrolled_steps`)."""
    return unroll_plan(batch.seq_lens, num_steps, batch.chain_windows)


def step_token_counts(batch: PackedBatch, plan: list[UnrollStep], num_steps: int) -> torch.Tensor:
    """[num_steps] trained positions per unroll step (the loss's normaliser, summed over ranks and micro batches)."""
    counts = torch.zeros(num_steps)
    for k, step in enumerate(plan):
        counts[k] = batch.loss_mask[step.token_index].sum()
    return counts


def unrolled_steps(head: DraftHead, batch: PackedBatch, plan: list[UnrollStep],
                   autocast: bool = False) -> Iterator[tuple[UnrollStep, ModelOutput]]:
    """The head's drafting steps over a packed batch (TTT attention) by its plan, one (step, output) per step,
    the step's indices on the batch's device.
    autocast: the head's linear layers in bf16 under torch.autocast (attention stays in the batch's dtype)."""
    device = batch.input_ids.device
    attn = ChainAttention(batch.hidden_states.dtype)
    kv_caches = [(None, None)] if head.mla else [None]
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    mixed = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    with mixed:
        hidden = head.features(batch.hidden_states, batch.aux_hidden_states)  # step 0 reads the target's features
    for step in plan:
        step = step.to(device)
        attn.begin_step(step.records, step.seq_lens, step.starts)
        with mixed:
            out = head(batch.input_ids[step.token_index], step.positions, attn, kv_caches, no_logits,
                       hidden_states=hidden[step.prev_index])
        if autocast:  # the losses and the next step read the states in the training dtype
            out = replace(out, hidden_states=out.hidden_states.to(batch.hidden_states.dtype))
        yield step, out
        hidden = out.hidden_states


class UnrolledHead(nn.Module):
    def __init__(self, head: DraftHead, norm_weight: torch.Tensor, eps: float, num_steps: int,
                 weights: LossWeights, autocast: bool = False) -> None:
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"loss.unroll_steps must be >= 1, got {num_steps}")
        self.head = head
        norm = RMSNorm(norm_weight.shape[0], eps)
        norm.weight = nn.Parameter(norm_weight, requires_grad=False)
        self.__dict__["target_norm"] = norm  # the frozen target's final norm: not a submodule, never saved or cast
        self.num_steps, self.weights = num_steps, weights
        self.autocast = autocast  # trainer.autocast: the head's linear layers in bf16, the losses in fp32

    def forward(self, batch: PackedBatch, normalisers: torch.Tensor, plan: list[UnrollStep] | None = None,
                return_agreement: bool = False) -> tuple:
        """Returns (loss, stats [num_steps, len(STATS)]: sums over trained positions), and with return_agreement
        the per-step agreement [T_k] bool (the head's argmax is the target's) in the plan's row order.
        plan: the batch's `batch_plan`, built once by the caller that counted the normalisers on it (None: built)."""
        head, w = self.head, self.weights
        plan = batch_plan(batch, self.num_steps) if plan is None else plan
        device = batch.input_ids.device
        target = target_distribution(batch.hidden_states, self.target_norm, head.shared.lm_head, head.draft_token_ids(),
                                     w.chunk_tokens)
        lm_head_weight = head.lm_head_weight()  # [draft vocab, H]
        stats = torch.zeros(self.num_steps, len(STATS), device=device)
        loss = torch.zeros((), device=device)
        chain = None  # [T_k] bool: the head agreed with the target at every step so far, per anchor
        agreement = []
        for k, (step, out) in enumerate(unrolled_steps(head, batch, plan, self.autocast)):
            token_weight = batch.loss_mask[step.token_index].float()
            scale = w.step_decay**k / normalisers[k].clamp(min=1)
            kl_ce, step_stats, agree = distill_loss(head.final_norm(out.hidden_states), lm_head_weight,
                                                    target.rows(step.token_index), token_weight, w.kl, w.ce,
                                                    w.chunk_tokens, w.tv)
            trained = token_weight != 0
            reached = trained if chain is None else trained & chain[step.prev_index]
            chain = agree if chain is None else agree & chain[step.prev_index]
            with torch.set_grad_enabled(torch.is_grad_enabled() and w.feature != 0):  # reported even when unweighted
                feat = feature_loss(out.hidden_states, batch.hidden_states[step.token_index], token_weight)
            loss = loss + scale * (kl_ce + w.feature * feat if w.feature != 0 else kl_ce)
            chained = torch.stack((reached.sum(), (reached & agree).sum())).float()
            stats[k] = torch.cat((step_stats, chained, feat.detach()[None]))
            agreement.append(agree)
        return (loss, stats, agreement) if return_agreement else (loss, stats)


def per_step_means(sums: torch.Tensor, counts: torch.Tensor) -> dict:
    """sums [K, len(STATS)] and counts [K] -> {kl_0: ..., top1_0: ..., cond_top1_0: ...}.

    top1_k is step k's teacher-forced agreement over every trained anchor; cond_top1_k its agreement where steps
    0..k-1 agreed too, the trainer's counterpart of the runtime's conditional acceptance at draft position k + 1.
    1 - tv_0 is the acceptance a sampled draft would get at position 1 on the training text (at T=1)."""
    out = {}
    for k in range(sums.shape[0]):
        n = max(float(counts[k]), 1.0)
        kl, ce, agree, tv, reached, reached_top1, feat = sums[k].tolist()
        out.update({f"kl_{k}": kl / n, f"ce_{k}": ce / n, f"top1_{k}": agree / n, f"tv_{k}": tv / n,
                    f"feature_{k}": feat / n, f"cond_top1_{k}": reached_top1 / max(reached, 1.0)})
    return out


def verify_walk(agrees, first: int, length: int, k: int, reached: list[int], accepted: list[int]) -> None:
    """Walk a greedy runtime's verify steps over one text of `length` tokens from anchor `first`, counting per draft
    position the steps that reached it and those that accepted it: agrees(anchor, j) says whether draft j + 1 at
    that anchor is the text's token (at anchor + 1 + j); a step moves the anchor by its accepted drafts + 1."""
    anchor = first
    while anchor <= length - 2:  # the first draft at this anchor has a target inside the text
        drafts = 0
        while drafts < k and anchor + 1 + drafts <= length - 1:
            reached[drafts] += 1
            if not agrees(anchor, drafts):
                break
            accepted[drafts] += 1
            drafts += 1
        anchor += drafts + 1


def replay_report(means: dict, accepted: list[int], reached: list[int], positions: int, k: int) -> dict:
    """The replay's figures (mtp_train.validate.trainer_replay): per draft position, the trainer's top-1 and
    conditional top-1 over every anchor, its conditional top-1 at the runtime's verify steps, and KL."""
    return {"top1": [round(means[f"top1_{j}"], 4) for j in range(k)],
            "cond_top1": [round(means[f"cond_top1_{j}"], 4) for j in range(k)],
            "at_verify_steps": [round(a / n, 4) if n else 0.0 for a, n in zip(accepted, reached)], "reached": reached,
            "kl": [round(means[f"kl_{j}"], 4) for j in range(k)], "positions": positions,
            "on": "the plain engine's greedy continuations of the prompts"}
