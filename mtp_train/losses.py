"""The head's losses, with [tokens, vocab] logits only ever one chunk of tokens at a time.

Per trained position (weights from conf/config.yaml `loss`):
  kl       forward KL(p || q): p the target's next-token distribution recomputed from its stored hidden state
           (frozen final norm + lm_head), q the head's
  ce       cross-entropy of q against argmax p (the target's greedy token)
  feature  SmoothL1(h'_i, h_{i+1}) averaged over the hidden size (EAGLE-1's regression on features)

`distill_loss` is a fused "lm_head + KL + CE" autograd function: its forward walks the tokens in chunks,
computes each chunk's fp32 logits, loss and the gradient with respect to its input (q - p, q - onehot),
multiplies that by lm_head's weight and keeps only the [T, H] result; backward scales it. So the peak is one
chunk's few [chunk, vocab] fp32 buffers, never [T, vocab] (2 GB per copy for 4096 tokens of a 128k vocab),
and the logits are not recomputed in backward. The lm_head weight is frozen: no gradient is formed for it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from data_tools.features import next_token_logits


class _DistillLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lm_head_weight, target_hidden, norm_weight, token_weight, eps, w_kl, w_ce, chunk):
        """x [T, H] the head's final-normed states; target_hidden [T, H] the target's pre-norm states;
        token_weight [T] fp32 (0 on untrained positions). Returns (weighted loss sum, stats [3]): stats are the
        unweighted sums over positions with token_weight > 0 of KL, CE and top-1 agreement."""
        need_grad = ctx.needs_input_grad[0]
        grad_x = torch.empty_like(x) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        stats = torch.zeros(3, dtype=torch.float32, device=x.device)
        for start in range(0, x.shape[0], chunk):
            end = min(start + chunk, x.shape[0])
            weight = token_weight[start:end]
            trained = (weight != 0).float()
            logits = F.linear(x[start:end], lm_head_weight).float()  # [c, V]: the runtime's compute_logits
            log_q = torch.log_softmax(logits, dim=-1)
            del logits
            with torch.no_grad():
                target_logits = next_token_logits(target_hidden[start:end], norm_weight, lm_head_weight, eps)
                greedy = target_logits.argmax(-1)  # [c]
                log_p = torch.log_softmax(target_logits, dim=-1)
                del target_logits
            p = log_p.exp()
            kl = (p * (log_p - log_q)).sum(-1)  # [c]
            del log_p
            ce = -log_q.gather(-1, greedy[:, None])[:, 0]
            agree = (log_q.argmax(-1) == greedy).float()
            loss += (weight * (w_kl * kl + w_ce * ce)).sum()
            stats += torch.stack(((trained * kl).sum(), (trained * ce).sum(), (trained * agree).sum()))
            if need_grad:
                # d/dlogits of w_kl * KL(p||q) + w_ce * CE(argmax p): (w_kl + w_ce) q - w_kl p - w_ce onehot
                grad_logits = log_q.exp_().mul_(w_kl + w_ce).sub_(p, alpha=w_kl)
                grad_logits[torch.arange(end - start, device=x.device), greedy] -= w_ce
                grad_logits.mul_(weight[:, None])
                grad_x[start:end] = (grad_logits.to(lm_head_weight.dtype) @ lm_head_weight).to(x.dtype)
            del p, log_q
        ctx.save_for_backward(grad_x)
        ctx.mark_non_differentiable(stats)
        return loss, stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        (grad_x,) = ctx.saved_tensors
        return (grad_x * grad_loss.to(grad_x.dtype),) + (None,) * 8


def distill_loss(x: torch.Tensor, lm_head_weight: torch.Tensor, target_hidden: torch.Tensor,
                 norm_weight: torch.Tensor, token_weight: torch.Tensor, eps: float, w_kl: float, w_ce: float,
                 chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """sum_i token_weight_i * (w_kl KL_i + w_ce CE_i) and stats (KL, CE, agreement sums); see _DistillLoss."""
    if chunk < 1:
        raise ValueError(f"loss.chunk_tokens must be >= 1, got {chunk}")
    return _DistillLoss.apply(x, lm_head_weight, target_hidden, norm_weight, token_weight.float(), eps,
                              float(w_kl), float(w_ce), int(chunk))


def feature_loss(head_hidden: torch.Tensor, target_hidden: torch.Tensor, token_weight: torch.Tensor) -> torch.Tensor:
    """sum_i token_weight_i * mean_d SmoothL1(h'_i,d, h_{i+1},d), in fp32."""
    per_token = F.smooth_l1_loss(head_hidden.float(), target_hidden.float(), reduction="none").mean(-1)
    return (token_weight.float() * per_token).sum()
