"""A test drafter for speed checks at a known acceptance: it runs a real EAGLE-3 head's forwards (its catch-up and
its K-1 drafts, at their true cost) but proposes the target's own greedy tokens, taken from a plain run of the same
prompts, each draft right with a set probability given the ones before it right (wrong: the next token id).

Random-weight targets accept nothing from any head, so a speedup through the runtime is only measurable this way
(issue #46). Greedy requests only: the verify compares the drafts with the target's argmax.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import Tensor

from infer.device_copy import device_tensor
from infer.engine import Engine
from infer.models.head_base import DraftHead
from infer.sampler import SamplingTensors
from infer.speculative import Eagle3Drafter, SpeculatingRequest


class OracleDrafter(Eagle3Drafter):
    """An `Eagle3Drafter` whose proposals are the target's greedy continuation, each right with probability
    `acceptance` while the ones before it are."""

    def configure(self, continuations: dict[tuple[int, ...], list[int]], acceptance: float, seed: int = 0) -> None:
        """continuations: prompt ids -> the target's greedy output ids for it (a plain run's)."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must lie in [0, 1], got {acceptance}")
        self.continuations, self.acceptance, self.rng = continuations, acceptance, random.Random(seed)
        self.vocab_size = self.runner.model.config.vocab_size

    def draft(self, requests: Sequence[SpeculatingRequest], k: int, sampling: SamplingTensors,
              generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor | None]:
        """The head's drafts are computed (and dropped: their cost is what counts), then the oracle's go in, built on
        the host from the request's own output so far (no device read)."""
        if not sampling.all_greedy:
            raise ValueError("the oracle drafter serves greedy requests only")
        super().draft(requests, k, sampling, generators)
        rows = []
        for request in requests:
            continuation = self.continuations[tuple(request.prompt_ids)]
            done, row, right = len(request.output_ids), [], True
            for j in range(k):
                token = continuation[done + j] if done + j < len(continuation) else 0
                right = right and self.rng.random() < self.acceptance
                row.append(token if right else (token + 1) % self.vocab_size)
            rows.append(row)
        return device_tensor(rows, self.device), None


def attach_oracle(engine: Engine, head: DraftHead, continuations: dict[tuple[int, ...], list[int]],
                  acceptance: float, seed: int = 0) -> OracleDrafter:
    """Attach an oracle drafter over `head` as `Engine.attach_drafter` attaches an EAGLE-3 head (the same runner,
    graphs and pages)."""
    engine.attach_drafter("eagle3", head)  # its checks, and the drafter it would build
    drafter = OracleDrafter(head, engine.pool.num_pages, engine.config.page_size, engine.config.backend,
                            engine.graph_settings)
    drafter.configure(continuations, acceptance, seed)
    engine.drafter = drafter
    engine.reset_spec_stats()
    return drafter
