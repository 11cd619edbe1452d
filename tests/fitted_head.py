"""A draft head fitted in the test: the target's last layer trained a few dozen steps on the target's own greedy
continuations of stories openings (the unrolled objective the trainer runs, without DeepSpeed). It drafts well
enough (conditional acceptance 0.3-0.6 per position on held-out openings) that a broken replay, a broken sharded
head or a broken verifier shows, where an untrained head accepts nothing on either side."""

from __future__ import annotations

import torch

from infer.engine import Engine
from infer.models.mtp_head import DraftHead, init_head_from_target
from infer.prompts import VALIDATION_PROMPTS
from infer.sampling_params import SamplingParams
from mtp_train.data import PackedBatch, step_token_counts
from mtp_train.unroll import LossWeights, UnrolledHead
from mtp_train.validate import packed_target_forward

TRAIN_PROMPTS = VALIDATION_PROMPTS[16:32]  # apart from the openings tests validate on (the first ones)


def fit_head(engine: Engine, steps: int = 30, k: int = 3, lr: float = 1e-2, seed: int = 0) -> DraftHead:
    """An MTP head from the target's last layer, fitted `steps` Adam steps on 16 greedy continuations of 64 tokens."""
    torch.manual_seed(seed)
    model = engine.model
    requests = engine.generate(TRAIN_PROMPTS, SamplingParams(max_new_tokens=64, ignore_eos=True))
    sequences, prompt_lens = [r.token_ids for r in requests], [len(r.prompt_ids) for r in requests]
    head = init_head_from_target(model, "stories260K").train().requires_grad_(True)
    target = packed_target_forward(model, sequences, head.target_aux_layers)
    trained = torch.cat([torch.arange(len(seq)) >= n for seq, n in zip(sequences, prompt_lens)])
    batch = PackedBatch(torch.tensor([t for seq in sequences for t in seq]), target.hidden_states, trained,
                        [len(seq) for seq in sequences], list(range(len(sequences))), None)
    objective = UnrolledHead(head, model.model.norm.weight, float(model.config.rms_norm_eps), k, LossWeights())
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    counts = step_token_counts(batch, k).float()
    for _ in range(steps):
        loss, _ = objective(batch, counts)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)
