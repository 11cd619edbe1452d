"""The draft vocabulary of an EAGLE-3 head: the target ids its lm_head scores (d2t / t2d in the head).

Two rules, measured on the training features' trained positions:
  probability  the ids with the most target probability mass: sum over positions of p(x) (the target's
               next-token distribution recomputed from its stored hidden states), the quantity acceptance needs:
               a draft vocabulary D can at best be accepted with probability sum_{x in D} p(x) at a position
  frequency    the ids that occur most often as trained tokens (SpecForge's and EAGLE-3's rule)
Both are reported with the share of probability mass they cover (`coverage`), on the training records they were
chosen from and on the held-out ones, so the two rules are compared at the same size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from data_tools.features import FeatureDataset
from infer.models.common import final_logits
from mtp_train.target import Target

RULES = ("probability", "frequency")


@dataclass
class TokenScores:
    mass: torch.Tensor  # [V] fp64 summed target probability over trained positions
    count: torch.Tensor  # [V] fp64 occurrences as a trained token
    positions: int


@torch.no_grad()
def token_scores(dataset: FeatureDataset, indices: list[int], target: Target, max_tokens: int,
                 chunk: int = 4096) -> TokenScores:
    """Both scores over the records `indices` in order, until max_tokens trained positions were read."""
    vocab = target.config.vocab_size
    lm_head = target.shared.lm_head.weight
    mass = torch.zeros(vocab, dtype=torch.float64, device=lm_head.device)
    count = torch.zeros(vocab, dtype=torch.float64, device=lm_head.device)
    positions = 0
    for index in indices:
        if positions >= max_tokens:
            break
        record = dataset[index]
        # position j's distribution is over t_{j+1}: trained where token j+1 is (loss_mask[j+1])
        trained = record["loss_mask"][1:].nonzero().flatten()[: max_tokens - positions]
        hidden = record["hidden_states"][trained].to(lm_head.device, lm_head.dtype)
        for start in range(0, hidden.shape[0], chunk):
            logits = final_logits(target.shared.final_norm, target.shared.lm_head, hidden[start:start + chunk])
            mass += torch.softmax(logits, -1).sum(0, dtype=torch.float64)
        count += torch.bincount(record["input_ids"][1:][trained].to(count.device), minlength=vocab).double()
        positions += int(trained.numel())
    return TokenScores(mass, count, positions)


def choose(scores: TokenScores, size: int, rule: str) -> torch.Tensor:
    """[size] target ids, sorted ascending: the top `size` by the rule's score (ties: the lower id)."""
    if rule not in RULES:
        raise ValueError(f"head.draft_vocab_rule={rule!r}: choose one of {', '.join(RULES)}")
    score = scores.mass if rule == "probability" else scores.count
    order = torch.argsort(-score.cpu(), stable=True)
    return order[:size].sort().values


def coverage(scores: TokenScores, ids: torch.Tensor) -> float:
    """The share of the target's probability mass on `ids`, over the scored positions."""
    total = float(scores.mass.sum())
    return float(scores.mass[ids.to(scores.mass.device)].sum()) / total if total else 0.0
