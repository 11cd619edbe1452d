"""A block head fitted in the test (tests/fitted_head.py's recipe for the block objective, without DeepSpeed): one
layer started from the target's last one, trained on the target's own greedy continuations of stories openings,
so that its drafts are accepted often enough for a broken catch-up, replay or verifier to show. The block's mask rows
must first learn to attend to the pending token's row (the loss sits at the unigram plateau for ~60 Adam steps), so it
takes more steps than the MTP head's fit."""

from __future__ import annotations

import torch

from infer.engine import Engine
from infer.models.block_head import BlockHead
from infer.models.mtp_head import init_head_from_target
from mtp_train.block_unroll import BlockObjective
from mtp_train.unroll import LossWeights
from tests.fitted_head import TRAIN_PROMPTS, adam_fit, greedy_batch


def objective_for(engine: Engine, head: BlockHead, anchors: int = 16, gamma: float = 7.0) -> BlockObjective:
    model = engine.model
    return BlockObjective(head, model.model.norm.weight, float(model.config.rms_norm_eps),
                          LossWeights(kl=1.0, ce=0.0), anchors, gamma)


def fit_block_head(engine: Engine, block_size: int = 16, num_layers: int = 1, steps: int = 140, lr: float = 1e-2,
                   seed: int = 0) -> BlockHead:
    torch.manual_seed(seed)
    head = init_head_from_target(engine.model, "stories260K", "block", block_size=block_size, num_layers=num_layers)
    batch, _ = greedy_batch(engine, TRAIN_PROMPTS[:8], head.target_aux_layers)
    head.train().requires_grad_(True)
    objective = objective_for(engine, head)
    plan = objective.plan(batch)
    return adam_fit(head, objective, batch, plan, objective.counts(batch, plan), steps, lr)
