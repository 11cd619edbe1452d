"""mtp_train.losses: the chunked fused loss equals the materialised one, in value and in gradient (the head's input
and, when trainable, its lm_head rows), over the whole vocabulary and over a draft vocabulary; the target's
distribution is computed once and read by rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from infer.models.common import RMSNorm
from mtp_train.losses import distill_loss, feature_loss, target_distribution


def _target_modules(norm_weight, lm_head_weight, eps=1e-5):
    """The target's final norm and lm_head as modules around the given weights."""
    norm = RMSNorm(norm_weight.shape[0], eps)
    norm.weight = torch.nn.Parameter(norm_weight, requires_grad=False)
    lm_head = torch.nn.Linear(*lm_head_weight.shape[::-1], bias=False)
    lm_head.weight = torch.nn.Parameter(lm_head_weight, requires_grad=False)
    return norm, lm_head


def reference_distill_loss(x, head_weight, target_hidden, norm_weight, lm_head_weight, token_weight, eps, w_kl, w_ce,
                           draft_ids=None, w_tv=0.0):
    """The same loss with the whole [T, V] logits materialised, by plain autograd: the tests' reference."""
    log_q = torch.log_softmax(F.linear(x, head_weight).float(), dim=-1)
    x = target_hidden.float()
    target_logits = (norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))) @ lm_head_weight.T
    top = target_logits.argmax(-1)
    drafted = torch.ones_like(top, dtype=torch.bool)
    if draft_ids is not None:
        to_draft = torch.full((lm_head_weight.shape[0],), -1)
        to_draft[draft_ids] = torch.arange(draft_ids.numel())
        target_logits, top = target_logits[:, draft_ids], to_draft[top]
        drafted = top >= 0
    log_p = torch.log_softmax(target_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce = -log_q.gather(-1, top.clamp(min=0)[:, None])[:, 0]
    tv = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    return (token_weight.float() * drafted * (w_kl * kl + w_ce * ce + w_tv * tv)).sum(), log_p, log_q, top


def _inputs(tokens=37, hidden=16, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / 4
    target = torch.randn(tokens, hidden, generator=g, dtype=torch.float64) * 3
    norm = 1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)
    mask = (torch.rand(tokens, generator=g) > 0.3).double()
    return x, lm_head, target, norm, mask


@pytest.mark.parametrize("chunk", [1, 5, 1000])
@pytest.mark.parametrize("w_kl,w_ce,w_tv", [(1.0, 0.0, 0.0), (0.0, 1.0, 0.0), (0.0, 0.0, 1.0), (0.7, 0.3, 3.0)])
@pytest.mark.parametrize("vocab", ["whole", "draft"])
def test_chunked_equals_materialised_value_and_gradient(chunk, w_kl, w_ce, w_tv, vocab):
    x, lm_head, target, norm, mask = _inputs()
    draft_ids = torch.arange(0, 101, 2) if vocab == "draft" else None  # half the vocabulary: some argmaxes outside
    head_weight = (lm_head if draft_ids is None else lm_head[draft_ids]).clone().requires_grad_()
    dist = target_distribution(target, *_target_modules(norm, lm_head), draft_ids, chunk=7)
    loss, stats, agree = distill_loss(x, head_weight, dist, mask, w_kl, w_ce, chunk, w_tv)
    grad, grad_w = torch.autograd.grad(loss * 1.7, (x, head_weight))  # a non-unit upstream gradient
    ref, log_p, log_q, top = reference_distill_loss(x, head_weight, target, norm, lm_head, mask, 1e-5, w_kl, w_ce,
                                                    draft_ids, w_tv)
    ref_grad, ref_grad_w = torch.autograd.grad(ref * 1.7, (x, head_weight))
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)  # logits are fp32, as in training
    torch.testing.assert_close(grad_w, ref_grad_w, rtol=1e-4, atol=1e-5)
    # stats: unweighted sums over trained positions (KL where the target's argmax is drafted)
    drafted = (top >= 0).double()
    kl = (log_p.exp() * (log_p - log_q.detach())).sum(-1)
    matches = (log_q.detach().argmax(-1) == top) & (top >= 0)
    torch.testing.assert_close(stats[0].double(), (kl * mask * drafted).sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[2].double(), (matches.double() * mask).sum())
    tv = 0.5 * (log_p.exp() - log_q.detach().exp()).abs().sum(-1)  # reported whatever its weight
    torch.testing.assert_close(stats[3].double(), (tv * mask * drafted).sum(), rtol=1e-5, atol=1e-6)
    assert torch.equal(agree, matches)
    if vocab == "draft":
        assert 0 < int(drafted.sum()) < len(drafted)  # the case a draft vocabulary brings is exercised


def test_loss_mask_respected_and_kl_zero_when_head_equals_target():
    x, lm_head, target, norm, mask = _inputs()
    dist = target_distribution(target, *_target_modules(norm, lm_head), None, chunk=8)
    normed = (target * torch.rsqrt(target.pow(2).mean(-1, keepdim=True) + 1e-5) * norm).detach().requires_grad_()
    loss, stats, _ = distill_loss(normed, lm_head, dist, mask, 1.0, 0.0, 8)
    assert abs(loss.item()) < 1e-5 and stats[2].item() == mask.sum().item()
    # changing an untrained position changes neither the loss nor its gradient elsewhere
    x2 = x.detach().clone()
    off = int((mask == 0).nonzero()[0])
    x2[off] += 5
    a = distill_loss(x.detach(), lm_head, dist, mask, 1.0, 0.5, 8)[0]
    b = distill_loss(x2, lm_head, dist, mask, 1.0, 0.5, 8)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert feature_loss(x, x.detach() + (1 - mask)[:, None] * 3, mask).item() == 0.0
    # rows of the distribution are the distribution of those rows
    rows = torch.tensor([3, 0, 3])
    torch.testing.assert_close(dist.rows(rows).probs, target_distribution(target[rows], *_target_modules(norm, lm_head), None, 2).probs)
