"""mtp_train.losses: the chunked fused loss equals the materialised one, in value and in gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from data_tools.features import next_token_logits
from mtp_train.losses import distill_loss, feature_loss


def reference_distill_loss(x, lm_head_weight, target_hidden, norm_weight, token_weight, eps, w_kl, w_ce):
    """The same loss with the whole [T, V] logits materialised, by plain autograd: the tests' reference."""
    log_q = torch.log_softmax(F.linear(x, lm_head_weight).float(), dim=-1)
    target_logits = next_token_logits(target_hidden, norm_weight, lm_head_weight, eps)
    log_p = torch.log_softmax(target_logits, dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    ce = F.nll_loss(log_q, target_logits.argmax(-1), reduction="none")
    return (token_weight.float() * (w_kl * kl + w_ce * ce)).sum()


def _inputs(tokens=37, hidden=16, vocab=101, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    lm_head = torch.randn(vocab, hidden, generator=g, dtype=torch.float64) / 4
    target = torch.randn(tokens, hidden, generator=g, dtype=torch.float64) * 3
    norm = 1 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)
    mask = (torch.rand(tokens, generator=g) > 0.3).double()
    return x, lm_head, target, norm, mask


@pytest.mark.parametrize("chunk", [1, 5, 16, 1000])
@pytest.mark.parametrize("w_kl,w_ce", [(1.0, 0.0), (0.0, 1.0), (0.7, 0.3)])
def test_chunked_equals_materialised_value_and_gradient(chunk, w_kl, w_ce):
    x, lm_head, target, norm, mask = _inputs()
    loss, stats = distill_loss(x, lm_head, target, norm, mask, 1e-5, w_kl, w_ce, chunk)
    (grad,) = torch.autograd.grad(loss * 1.7, x)  # a non-unit upstream gradient
    ref = reference_distill_loss(x, lm_head, target, norm, mask, 1e-5, w_kl, w_ce)
    (ref_grad,) = torch.autograd.grad(ref * 1.7, x)
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-4, atol=1e-6)  # logits are fp32, as in training
    # stats: unweighted sums over trained positions
    log_p = torch.log_softmax(next_token_logits(target, norm, lm_head, 1e-5), -1)
    log_q = torch.log_softmax(x.detach() @ lm_head.T, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    agree = (log_q.argmax(-1) == log_p.argmax(-1)).double()
    torch.testing.assert_close(stats[0].double(), (kl * mask).sum(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(stats[2].double(), (agree * mask).sum())


def test_loss_mask_respected_and_kl_zero_when_head_equals_target():
    x, lm_head, target, norm, mask = _inputs()
    normed = (target * torch.rsqrt(target.pow(2).mean(-1, keepdim=True) + 1e-5) * norm).detach().requires_grad_()
    loss, stats = distill_loss(normed, lm_head, target, norm, mask, 1e-5, 1.0, 0.0, 8)
    assert abs(loss.item()) < 1e-5 and stats[2].item() == mask.sum().item()
    # changing an untrained position changes neither the loss nor its gradient elsewhere
    x2 = x.detach().clone()
    off = int((mask == 0).nonzero()[0])
    x2[off] += 5
    a = distill_loss(x.detach(), lm_head, target, norm, mask, 1e-5, 1.0, 0.5, 8)[0]
    b = distill_loss(x2, lm_head, target, norm, mask, 1e-5, 1.0, 0.5, 8)[0]
    assert a.item() == pytest.approx(b.item(), rel=1e-12)
    assert feature_loss(x, x.detach() + (1 - mask)[:, None] * 3, mask).item() == 0.0
