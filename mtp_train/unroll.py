"""The training forward: the head applied K times on its own hidden states, as the runtime drafts.

`UnrolledHead` is the module DeepSpeed wraps. Its only registered submodule is the head, so the engine's
parameters, optimizer state and checkpoints are the head's alone; the target's frozen tensors (embedding,
lm_head, final norm) are referenced through plain attributes. Each step runs infer's `MTPHead.forward` with
`infer.attention.PackedCausalAttention` (4-D SDPA calls: causal within each record, no KV cache), then the
chunked losses of mtp_train.losses.

    loss = sum_k step_decay^k / N_k * sum_i mask_{k,i} (w_kl KL + w_ce CE + w_feature SmoothL1)

N_k (trained positions at step k over the whole global batch: all ranks and micro batches) is passed in by the
trainer, so the gradient does not depend on how the global batch is split over ranks and accumulation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn

from infer.models.mtp_head import MTPHead
from infer.attention import PackedCausalAttention
from mtp_train.data import PackedBatch, unroll_plan
from mtp_train.losses import distill_loss, feature_loss


@dataclass
class LossWeights:
    kl: float = 1.0
    ce: float = 0.0
    feature: float = 0.0
    step_decay: float = 0.8  # step k weighs step_decay ** k
    chunk_tokens: int = 512

    @classmethod
    def from_config(cls, loss: DictConfig) -> "LossWeights":
        """From the `loss` node of the training config (mtp_train.config.LossConfig)."""
        return cls(kl=loss.kl, ce=loss.ce, feature=loss.feature, step_decay=loss.step_decay,
                   chunk_tokens=loss.chunk_tokens)


class UnrolledHead(nn.Module):
    def __init__(self, head: MTPHead, norm_weight: torch.Tensor, eps: float, num_steps: int,
                 weights: LossWeights) -> None:
        super().__init__()
        if num_steps < 1:
            raise ValueError(f"loss.unroll_steps must be >= 1, got {num_steps}")
        self.head = head
        self.__dict__["norm_weight"] = norm_weight  # frozen target tensor: not a buffer, never saved or cast
        self.eps, self.num_steps, self.weights = eps, num_steps, weights

    def forward(self, batch: PackedBatch, normalisers: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (loss, stats [num_steps, 4]: sums of KL, CE, agreement, SmoothL1 over trained positions)."""
        head, w = self.head, self.weights
        lm_head_weight = head.shared.lm_head.weight
        device = batch.input_ids.device
        stats = torch.zeros(self.num_steps, 4, device=device)
        loss = torch.zeros((), device=device)
        fed = head.target_input(batch.hidden_states)  # the target's h_i as the head reads them (post_norm: normed)
        hidden = fed  # step 0 reads the target's h_i
        no_logits = torch.empty(0, dtype=torch.long, device=device)
        for k, step in enumerate(unroll_plan(batch.seq_lens, self.num_steps, device)):
            attn = PackedCausalAttention(step.seq_lens)
            kv_caches = [(None, None)] if head.mla else [None]
            out = head(batch.input_ids[step.token_index], step.positions, attn, kv_caches, no_logits,
                       hidden_states=hidden[step.prev_index])
            target_hidden = batch.hidden_states[step.token_index]  # pre-norm: distill_loss applies the norm
            token_weight = batch.loss_mask[step.token_index].float()
            scale = w.step_decay**k / normalisers[k].clamp(min=1)
            kl_ce, step_stats = distill_loss(
                head.final_norm(out.hidden_states), lm_head_weight, target_hidden, self.norm_weight, token_weight,
                self.eps, w.kl, w.ce, w.chunk_tokens,
            )
            with torch.set_grad_enabled(torch.is_grad_enabled() and w.feature != 0):  # reported even when unweighted
                feat = feature_loss(out.hidden_states, fed[step.token_index], token_weight)
            loss = loss + scale * (kl_ce + w.feature * feat if w.feature != 0 else kl_ce)
            stats[k] = torch.cat((step_stats, feat.detach()[None]))
            hidden = out.hidden_states
        return loss, stats
