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
from mtp_train.data import PackedBatch
from mtp_train.unroll import LossWeights, UnrolledHead, batch_plan, step_token_counts
from mtp_train.validate import packed_target_forward

TRAIN_PROMPTS = VALIDATION_PROMPTS[16:32]  # apart from the openings tests validate on (the first ones)


def greedy_batch(engine: Engine, prompts: list[str], aux_layers: tuple[int, ...], max_new_tokens: int = 64,
                 ) -> tuple[PackedBatch, list[int]]:
    """The plain engine's greedy continuations packed as the trainer reads them (the generated tokens trained), with
    the target's aux layers a head reads; and the prompts' lengths."""
    requests = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))
    sequences, prompt_lens = [r.token_ids for r in requests], [len(r.prompt_ids) for r in requests]
    target = packed_target_forward(engine.model, sequences, aux_layers)
    aux = torch.stack([target.aux_hidden_states[i] for i in aux_layers], dim=1) if aux_layers else None
    trained = torch.cat([torch.arange(len(seq)) >= n for seq, n in zip(sequences, prompt_lens)])
    batch = PackedBatch(torch.tensor([t for seq in sequences for t in seq]), target.hidden_states, trained,
                        [len(seq) for seq in sequences], list(range(len(sequences))), aux)
    return batch, prompt_lens


def fit_head(engine: Engine, head: DraftHead | None = None, steps: int = 30, k: int = 3, lr: float = 1e-2,
             seed: int = 0) -> DraftHead:
    """`head` (default: an MTP head from the target's last layer) fitted `steps` Adam steps on 16 greedy
    continuations of 64 tokens; an EAGLE-3 head reads the target layers it fuses."""
    torch.manual_seed(seed)
    model = engine.model
    head = init_head_from_target(model, "stories260K") if head is None else head
    batch, _ = greedy_batch(engine, TRAIN_PROMPTS, head.target_aux_layers)
    head.train().requires_grad_(True)
    objective = UnrolledHead(head, model.model.norm.weight, float(model.config.rms_norm_eps), k, LossWeights())
    plan = batch_plan(batch, k)
    return adam_fit(head, objective, batch, plan, step_token_counts(batch, plan, k), steps, lr)


def adam_fit(head: DraftHead, objective: torch.nn.Module, batch: PackedBatch, plan, counts: torch.Tensor, steps: int,
             lr: float) -> DraftHead:
    """`steps` Adam steps of `objective` (the trainer's module for the head) on one planned batch; the head frozen."""
    optimizer = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss, _ = objective(batch, counts, plan)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return head.eval().requires_grad_(False)
