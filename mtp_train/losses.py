"""The head's losses, with [tokens, vocab] logits only ever one chunk of tokens at a time.

Per trained position (weights from conf/config.yaml `loss`):
  kl       forward KL(p || q): p the target's next-token distribution (frozen final norm + lm_head on its stored
           hidden state), q the head's; both over the head's draft vocabulary (p renormalised there)
  ce       cross-entropy of q against argmax p (the target's greedy token)
  tv       total variation 1/2 sum_x |p(x) - q(x)|: one minus the acceptance of a draft sampled from q when the
           target samples from p (rejection sampling at the same temperature), what forward KL only bounds
  feature  SmoothL1(h'_i, h_{i+1}) averaged over the hidden size (EAGLE-1's regression on features)

`target_distribution` computes p once per micro batch, for every position of the packed batch (unroll step k reads
the rows of positions i+1+k, so every step reuses it instead of recomputing the target's logits K times). It keeps
p [T, Vd] in the training dtype (fp32 on CPU, bf16 on GPU: 2 bytes x tokens x draft vocabulary, 2.1 GB for 8,192
tokens of a 128k vocabulary), the target's argmax and sum p log p [T] in fp32.

`distill_loss` is a fused "lm_head + KL + CE" autograd function: its forward walks the tokens in chunks, computes
each chunk's fp32 logits, loss and the gradient with respect to its input (q - p, q - onehot), multiplies that by
lm_head's weight and keeps only the [T, H] result (and, for a trainable lm_head, the [Vd, H] weight gradient);
backward scales them. So the peak is one chunk's few [chunk, vocab] fp32 buffers, never [T, vocab] fp32, and the
logits are not recomputed in backward.

A position whose target argmax lies outside the draft vocabulary has no loss (as SpecForge's EAGLE-3 position
mask): the head cannot draft it, and such a draft is never accepted greedily. Its agreement counts as 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.common import final_logits


@dataclass
class TargetDistribution:
    """The target's next-token distribution at every position of a micro batch, over the draft vocabulary."""

    probs: torch.Tensor  # [T, Vd] p, training dtype
    greedy: torch.Tensor  # [T] long: the draft index of argmax p over the whole vocabulary, -1 outside the draft one
    neg_entropy: torch.Tensor  # [T] fp32 sum_x p log p

    def rows(self, index: torch.Tensor) -> "TargetDistribution":
        return TargetDistribution(self.probs[index], self.greedy[index], self.neg_entropy[index])


@torch.no_grad()
def target_distribution(hidden: torch.Tensor, norm: nn.Module, lm_head: nn.Linear, draft_ids: torch.Tensor | None,
                        chunk: int) -> TargetDistribution:
    """p from the target's pre-norm hidden states [T, H] through its final norm and lm_head; draft_ids [Vd] target
    ids (None: the whole vocabulary)."""
    if chunk < 1:
        raise ValueError(f"loss.chunk_tokens must be >= 1, got {chunk}")
    tokens = hidden.shape[0]
    vocab = lm_head.weight.shape[0]
    draft_vocab = vocab if draft_ids is None else draft_ids.numel()
    probs = torch.empty(tokens, draft_vocab, dtype=hidden.dtype, device=hidden.device)
    greedy = torch.empty(tokens, dtype=torch.long, device=hidden.device)
    neg_entropy = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
    to_draft = None
    if draft_ids is not None:  # target id -> draft index, -1 outside
        to_draft = torch.full((vocab,), -1, dtype=torch.long, device=hidden.device)
        to_draft[draft_ids] = torch.arange(draft_vocab, device=hidden.device)
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        logits = final_logits(norm, lm_head, hidden[start:end])  # [c, V] fp32
        top = logits.argmax(-1)
        if to_draft is not None:
            logits, top = logits[:, draft_ids], to_draft[top]
        log_p = torch.log_softmax(logits, dim=-1)
        p = log_p.exp()
        probs[start:end] = p.to(probs.dtype)
        greedy[start:end] = top
        neg_entropy[start:end] = (p * log_p).sum(-1)
    return TargetDistribution(probs, greedy, neg_entropy)


class _DistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lm_head_weight, probs, greedy, neg_entropy, token_weight, w_kl, w_ce, w_tv, chunk):
        """x [T, H] the head's final-normed states; probs [T, Vd], greedy [T], neg_entropy [T] the target's rows
        (TargetDistribution); token_weight [T] fp32 (0 on untrained positions). Returns (weighted loss sum, stats [4]:
        unweighted sums over positions with token_weight > 0 of KL and CE, where the target's argmax is drafted,
        of top-1 agreement, and of TV where drafted; agree [T] bool: the head's argmax is the target's)."""
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(lm_head_weight.shape, dtype=torch.float32, device=x.device) if need_w else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        stats = torch.zeros(4, dtype=torch.float32, device=x.device)
        agree = torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)
        for start in range(0, x.shape[0], chunk):
            end = min(start + chunk, x.shape[0])
            drafted = greedy[start:end] >= 0
            top = greedy[start:end].clamp(min=0)
            trained = (token_weight[start:end] != 0).float()
            weight = token_weight[start:end] * drafted.float()
            logits = F.linear(x[start:end], lm_head_weight).float()  # [c, Vd]: the runtime's compute_logits
            log_q = torch.log_softmax(logits, dim=-1)
            del logits
            p = probs[start:end].float()
            kl = neg_entropy[start:end] - (p * log_q).sum(-1)  # [c]
            ce = -log_q.gather(-1, top[:, None])[:, 0]
            agree[start:end] = (log_q.argmax(-1) == top) & drafted
            q = log_q.exp_()  # in place: log q is not read again (one [c, Vd] fp32 buffer fewer at the peak)
            diff = q - p
            sign = diff.sign() if w_tv and (need_x or need_w) else None
            tv = 0.5 * diff.abs_().sum(-1)  # [c], reported whatever its weight
            del diff
            loss += (weight * (w_kl * kl + w_ce * ce + w_tv * tv)).sum()
            counted = trained * drafted.float()
            stats += torch.stack(((counted * kl).sum(), (counted * ce).sum(), (trained * agree[start:end]).sum(),
                                  (counted * tv).sum()))
            if need_x or need_w:
                # d/dlogits of w_kl * KL(p||q) + w_ce * CE(argmax p): (w_kl + w_ce) q - w_kl p - w_ce onehot;
                # of w_tv * TV: w_tv / 2 * q_j (s_j - sum_x s_x q_x), s = sign(q - p)
                tv_grad = None
                if sign is not None:
                    tv_grad = sign.sub_((sign * q).sum(-1, keepdim=True)).mul_(q).mul_(0.5 * w_tv)
                grad_logits = q.mul_(w_kl + w_ce).sub_(p, alpha=w_kl)
                grad_logits[torch.arange(end - start, device=x.device), top] -= w_ce
                if tv_grad is not None:
                    grad_logits += tv_grad
                    del tv_grad
                grad_logits.mul_(weight[:, None])
                if need_x:
                    grad_x[start:end] = (grad_logits.to(lm_head_weight.dtype) @ lm_head_weight).to(x.dtype)
                if need_w:
                    grad_w += grad_logits.T @ x[start:end].float()
            del p, log_q, q, sign
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(lm_head_weight.dtype))
        ctx.mark_non_differentiable(stats, agree)
        return loss, stats, agree

    @staticmethod
    def backward(ctx, grad_loss, grad_stats, grad_agree):
        grad_x, grad_w = ctx.saved_tensors
        gx = grad_x * grad_loss.to(grad_x.dtype) if grad_x is not None else None
        gw = grad_w * grad_loss.to(grad_w.dtype) if grad_w is not None else None
        return (gx, gw) + (None,) * 8


def distill_loss(x: torch.Tensor, lm_head_weight: torch.Tensor, target: TargetDistribution,
                 token_weight: torch.Tensor, w_kl: float, w_ce: float, chunk: int,
                 w_tv: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_i token_weight_i * (w_kl KL_i + w_ce CE_i + w_tv TV_i), stats (KL, CE, agreement, TV sums), agree [T]);
    see _DistillLoss."""
    if chunk < 1:
        raise ValueError(f"loss.chunk_tokens must be >= 1, got {chunk}")
    loss, stats, agree = _DistillLoss.apply(x, lm_head_weight, target.probs, target.greedy, target.neg_entropy,
                                            token_weight.float(), float(w_kl), float(w_ce), float(w_tv), int(chunk))
    return loss, stats, agree


def feature_loss(head_hidden: torch.Tensor, target_hidden: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """sum_i token_weight_i * mean_d SmoothL1(h'_i,d, h_{i+1},d), in fp32."""
    per_token = F.smooth_l1_loss(head_hidden.float(), target_hidden.float(), reduction="none").mean(-1)
    return (token_weight.float() * per_token).sum()
