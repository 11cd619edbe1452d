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
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
from omegaconf import DictConfig
from torch import nn

from infer.models.common import ModelOutput
from infer.models.mtp_head import DraftHead
from mtp_train.data import PackedBatch, UnrollStep, unroll_plan
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
    def from_config(cls, loss: DictConfig) -> "LossWeights":
        """From the `loss` node of the training config (mtp_train.config.LossConfig)."""
        return cls(kl=loss.kl, ce=loss.ce, feature=loss.feature, tv=loss.tv, step_decay=loss.step_decay,
                   chunk_tokens=loss.chunk_tokens)


def unrolled_steps(head: DraftHead, batch: PackedBatch, num_steps: int,
                   autocast: bool = False) -> Iterator[tuple[UnrollStep, ModelOutput]]:
    """The head's num_steps drafting steps over a packed batch (TTT attention), one (plan, output) per step.
    autocast: the head's linear layers in bf16 under torch.autocast (attention stays in the batch's dtype)."""
    device = batch.input_ids.device
    attn = ChainAttention(batch.hidden_states.dtype)
    kv_caches = [(None, None)] if head.mla else [None]
    no_logits = torch.empty(0, dtype=torch.long, device=device)
    mixed = torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast)
    with mixed:
        hidden = head.features(batch.hidden_states, batch.aux_hidden_states)  # step 0 reads the target's features
    for step in unroll_plan(batch.seq_lens, num_steps, device, batch.chain_windows):
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
        self.__dict__["norm_weight"] = norm_weight  # frozen target tensor: not a buffer, never saved or cast
        self.eps, self.num_steps, self.weights = eps, num_steps, weights
        self.autocast = autocast  # trainer.autocast: the head's linear layers in bf16, the losses in fp32

    def forward(self, batch: PackedBatch, normalisers: torch.Tensor, return_agreement: bool = False) -> tuple:
        """Returns (loss, stats [num_steps, len(STATS)]: sums over trained positions), and with return_agreement
        the per-step agreement [T_k] bool (the head's argmax is the target's) in unroll_plan's row order."""
        head, w = self.head, self.weights
        device = batch.input_ids.device
        target = target_distribution(batch.hidden_states, self.norm_weight, head.shared.lm_head.weight, self.eps,
                                     head.draft_token_ids(), w.chunk_tokens)
        lm_head_weight = head.lm_head_weight()  # [draft vocab, H]
        stats = torch.zeros(self.num_steps, len(STATS), device=device)
        loss = torch.zeros((), device=device)
        chain = None  # [T_k] bool: the head agreed with the target at every step so far, per anchor
        agreement = []
        for k, (step, out) in enumerate(unrolled_steps(head, batch, self.num_steps, self.autocast)):
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
