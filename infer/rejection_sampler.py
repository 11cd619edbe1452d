"""Verification of K draft tokens against one target forward over K+1 positions (Leviathan et al., 2023).

Both verifiers return (output_token_ids [B, K+1] long, num_emitted [B] long): row b emits the accepted prefix of its
drafts, then one token from the target (a correction at the first rejection, or a bonus after K acceptances), so
1 <= num_emitted <= K+1 and output_token_ids[b, num_emitted[b]:] == -1.

`rejection_sample` is lossless: every emitted token is distributed as the target's p, whatever the draft's q.
Row b consumes generators[b] in a fixed order on every call, whatever it accepts: `torch.rand(K, generator=g)` (the
acceptance test of draft j uses the j-th value), then `torch.empty(V).exponential_(generator=g)` (the one token drawn
from the target side). Its tokens therefore depend only on its own seed and inputs, never on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from infer.sampler import draw_exponentials, exponential_race


def _emit(draft_token_ids: Tensor, num_accepted: Tensor, next_token: Tensor) -> tuple[Tensor, Tensor]:
    """Accepted drafts, then next_token at position num_accepted, then -1 padding."""
    batch, k = draft_token_ids.shape
    position = torch.arange(k + 1, device=draft_token_ids.device)
    tokens = F.pad(draft_token_ids, (0, 1), value=-1)  # [B, K+1]
    tokens = tokens.masked_fill(position >= num_accepted[:, None], -1)
    tokens.scatter_(1, num_accepted[:, None], next_token[:, None])
    return tokens, num_accepted + 1


def greedy_verify(draft_token_ids: Tensor, target_argmax: Tensor) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target's argmax; then emit the target's argmax at the first mismatch.

    draft_token_ids [B, K], target_argmax [B, K+1] (position K is the bonus after all K drafts).
    """
    k = draft_token_ids.shape[1]
    matches = draft_token_ids == target_argmax[:, :k]  # [B, K]
    num_accepted = matches.long().cumprod(-1).sum(-1)  # [B] length of the all-match prefix
    # Each accepted draft equals the argmax at its position: the emitted row is the argmax up to the first mismatch.
    position = torch.arange(k + 1, device=target_argmax.device)
    return target_argmax.masked_fill(position > num_accepted[:, None], -1), num_accepted + 1


def rejection_sample(
    draft_token_ids: Tensor,  # [B, K] long, draft j drawn from draft_probs[:, j]
    draft_probs: Tensor,  # [B, K, V] float32, q
    target_probs: Tensor,  # [B, K+1, V] float32, p
    generators: Sequence[torch.Generator],  # one per row
) -> tuple[Tensor, Tensor]:
    """Accept draft j with probability min(1, p_j(x)/q_j(x)); at the first rejection draw from
    normalize(max(0, p_j - q_j)) (p_j if that is all zero); after K acceptances draw a bonus token from p_K."""
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    uniforms = torch.empty(batch, k, device=device)
    for row, generator in zip(uniforms, generators):
        row.uniform_(generator=generator)
    exponentials = draw_exponentials(generators, target_probs.shape[-1], device)  # [B, V]
    return rejection_accept(draft_token_ids, draft_probs, target_probs, uniforms, exponentials)


def rejection_accept(draft_token_ids: Tensor, draft_probs: Tensor, target_probs: Tensor, uniforms: Tensor,
                     exponentials: Tensor) -> tuple[Tensor, Tensor]:
    """`rejection_sample` from drawn noise (uniforms [B, K], exponentials [B, V]): no host read, no data-dependent
    shape, so a CUDA graph or torch.compile(fullgraph=True) can hold it."""
    batch, k = draft_token_ids.shape
    device = draft_token_ids.device
    p_draft = target_probs[:, :k].gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, K] p_j(x_j)
    q_draft = draft_probs.gather(-1, draft_token_ids[..., None]).squeeze(-1)  # [B, K] q_j(x_j)
    accepted = uniforms * q_draft < p_draft  # u < p/q without dividing by q; a token with p = 0 is never accepted
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] in 0..K

    # The token after the accepted prefix comes from max(0, p_n - q_n) at n = num_accepted; taking q_K = 0 makes
    # that same expression the bonus distribution p_K.
    rows = torch.arange(batch, device=device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    q_next = draft_probs[rows, num_accepted.clamp(max=k - 1)].masked_fill((num_accepted == k)[:, None], 0.0)
    residual = (p_next - q_next).clamp_min(0.0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_next)
    # exponential_race is scale-invariant, so sampling the unnormalised residual is sampling normalize(residual).
    return _emit(draft_token_ids, num_accepted, exponential_race(residual, exponentials))
