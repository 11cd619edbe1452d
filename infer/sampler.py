"""Batched token sampling: temperature, top-k, top-p, with per-request generators.

Randomness comes only from each request's own torch.Generator, so a seeded request yields the same tokens whatever
else shares its batch. Unless the whole batch is greedy, each row b draws from generators[b] exactly once per `sample`
call: `torch.empty(V).exponential_(generator=g)`, V the vocabulary size. Greedy rows draw too but ignore the result;
an all-greedy batch draws nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from infer.device_copy import device_tensor
from infer.sampling_params import SamplingParams


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    """A request's generator; seed None takes one from the global RNG, so torch.manual_seed makes runs repeatable."""
    if seed is None:
        seed = int(torch.randint(0, 2**63 - 1, ()).item())
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


@dataclass
class SamplingTensors:
    """A batch's sampling parameters as tensors, built once per step, each on first use: an all-greedy batch (argmax
    only) builds none of them.

    Greedy rows hold temperature 1 and top_k 1, so `target_probs` gives them a one-hot at the argmax: one call then
    serves a mixed batch in speculative verification, where greedy rows reduce to exact-match acceptance.
    """

    params: Sequence[SamplingParams]
    device: torch.device | str
    all_greedy: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingTensors:
        return cls(params, device, all(p.greedy for p in params))

    @cached_property
    def temperature(self) -> Tensor:
        """[B] float32"""
        return device_tensor([1.0 if p.greedy else p.temperature for p in self.params], self.device, torch.float32)

    @cached_property
    def top_k(self) -> Tensor:
        """[B] long, 0 = off"""
        return device_tensor([1 if p.greedy else max(p.top_k, 0) for p in self.params], self.device)

    @cached_property
    def top_p(self) -> Tensor:
        """[B] float32, 1.0 = off"""
        return device_tensor([p.top_p for p in self.params], self.device, torch.float32)

    @cached_property
    def filtering(self) -> bool:
        """Whether any row filters by top-k or top-p (greedy rows do: top_k 1), known on the host so that
        `target_probs` need not read the device to skip its sort."""
        return any(p.greedy or p.top_k > 0 or p.top_p < 1.0 for p in self.params)

    @cached_property
    def greedy(self) -> Tensor:
        """[B] bool"""
        return device_tensor([p.greedy for p in self.params], self.device, torch.bool)


def target_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                 filtering: bool | None = None) -> Tensor:
    """softmax(logits / T), then top-k, then top-p, renormalised: [N, V] logits -> [N, V] float32 probabilities.

    Speculative decoding calls this for both the draft (q) and the target (p): the acceptance test is lossless only
    if both sides get identical processing.

    top-k keeps exactly k tokens, as torch.topk does; among logits tied at the k-th place the lower token id is kept
    (stable sort). top-p then keeps the smallest prefix of the sorted, top-k-renormalised distribution whose mass is
    >= top_p, which always includes the most likely token. top_k 0 and top_p 1.0 are exact no-ops.

    filtering: whether any row filters (`SamplingTensors.filtering`, known on the host); None reads it from the
    device, a host sync the engine's steps avoid by passing it.
    """
    scaled = logits.float() / temperature[:, None]
    k_active, p_active = top_k > 0, top_p < 1.0
    if filtering is None:
        filtering = bool((k_active | p_active).any())
    if not filtering:  # skip the [N, V] sort when no row filters
        return torch.softmax(scaled, dim=-1)

    # Sort logits, not probabilities: distinct logits can round to equal probabilities and reorder the tie-break.
    scaled_sorted, order = scaled.sort(dim=-1, descending=True, stable=True)  # [N, V] each
    rank = torch.arange(scaled.shape[-1], device=scaled.device)
    outside_k = k_active[:, None] & (rank >= top_k[:, None])
    probs_sorted = torch.softmax(scaled_sorted.masked_fill(outside_k, float("-inf")), dim=-1)
    mass_before = probs_sorted.cumsum(-1) - probs_sorted  # mass of strictly more likely tokens
    probs_sorted = probs_sorted.masked_fill(p_active[:, None] & (mass_before >= top_p[:, None]), 0.0)
    probs_sorted = probs_sorted / probs_sorted.sum(-1, keepdim=True)
    return torch.empty_like(probs_sorted).scatter_(-1, order, probs_sorted)


def exponential_race(weights: Tensor, exponentials: Tensor) -> Tensor:
    """argmax(w / E) over the last dim with E ~ Exp(1) iid picks index x with probability w[x] / sum(w).

    Scale-invariant, so w need not be normalised; no host sync, unlike torch.multinomial. E is floored at the
    smallest normal float because some backends emit exact zeros (pytorch/pytorch#22557, #192577), and 0 / 0 = NaN
    would let argmax pick a zero-weight token.
    """
    return (weights / exponentials.clamp_min(torch.finfo(exponentials.dtype).tiny)).argmax(-1)


def draw_exponentials(generators: Sequence[torch.Generator], vocab_size: int, device: torch.device | str) -> Tensor:
    """[B, V] Exp(1) draws, row b from generators[b] only."""
    exponentials = torch.empty(len(generators), vocab_size, device=device)
    for row, generator in zip(exponentials, generators):
        row.exponential_(generator=generator)
    return exponentials


def sample(logits: Tensor, st: SamplingTensors, generators: Sequence[torch.Generator]) -> Tensor:
    """[B, V] logits -> [B] long token ids: argmax for greedy rows, a draw from target_probs for the others.

    The request generators' draws are launched first (one kernel per row: each seeded row draws from its own
    generator alone), then `sample_with`, which reads nothing back to the host."""
    if st.all_greedy:
        return logits.argmax(-1)
    exponentials = draw_exponentials(generators, logits.shape[-1], logits.device)
    return sample_with(logits, st.greedy, st.temperature, st.top_k, st.top_p, exponentials, st.filtering)


def sample_with(logits: Tensor, greedy: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor,
                exponentials: Tensor, filtering: bool) -> Tensor:
    """`sample` from drawn Exp(1) noise [B, V]: gpt-fast's argmax(p / E), no host read and no data-dependent shape
    (the part of a step a CUDA graph or torch.compile(fullgraph=True) can hold)."""
    probs = target_probs(logits, temperature, top_k, top_p, filtering)
    return torch.where(greedy, logits.argmax(-1), exponential_race(probs, exponentials))
