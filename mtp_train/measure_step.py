"""Peak host memory of one training step of a head at a real model's shapes, with random weights.

    python -m mtp_train.measure_step model=llama3_1_8b [trainer.seq_len=4096] [loss.chunk_tokens=512]

Builds the model's head (random init) and random shared tensors in fp32 on the CPU, one packed record of
seq_len tokens of random features, and runs two steps of forward, backward and AdamW (plain torch, fp32: what
a CPU run keeps; the second step has the optimizer's moments), then prints the peak resident-set growth over
the process's baseline (before any weight exists) next to
`mtp_train.memory_plan`'s analytic minimum for the same step.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

import torch
from torch import nn

from infer.cli import run_cli
from infer.models.mtp_head import SharedTargetWeights, head_module
from mtp_train.data import PackedBatch
from mtp_train.config import compose_training
from mtp_train.heads import head_config, init_random
from mtp_train.memory_plan import memory_estimate
from mtp_train.target import Target, target_config
from mtp_train.unroll import LossWeights, UnrolledHead


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.measure_step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for mtp_train.train (model=..., loss.*=...)")
    cfg = compose_training(parser.parse_args(argv).overrides, complete=False)
    tokens = cfg.trainer.seq_len
    baseline = peak_rss()
    config = target_config(cfg.model, need_weights=False)
    vocab, hidden = config.vocab_size, config.hidden_size
    g = torch.Generator().manual_seed(0)
    embed = nn.Embedding(vocab, hidden).requires_grad_(False)
    embed.weight.normal_(0, 0.02, generator=g)
    lm_head = nn.Linear(hidden, vocab, bias=False).requires_grad_(False)
    if getattr(config, "tie_word_embeddings", False):
        lm_head.weight = embed.weight
    else:
        lm_head.weight.normal_(0, 0.02, generator=g)
    target = Target(cfg.model.name, config, SharedTargetWeights(embed, lm_head), torch.ones(hidden))
    head = head_module(head_config(config, cfg.head, {"name": cfg.model.name}))
    head.init_identity_projection()
    init_random(head.layer, 0.02)
    head.attach(target.shared)
    model = UnrolledHead(head, target.norm_weight, target.eps, cfg.loss.unroll_steps, LossWeights.from_config(cfg.loss))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-4, foreach=False)
    batch = PackedBatch(torch.randint(0, vocab, (tokens,), generator=g), torch.randn(tokens, hidden, generator=g),
                        torch.ones(tokens, dtype=torch.bool), [tokens], [0])
    after_weights = peak_rss()
    seconds = []
    for _ in range(2):  # the second step is the steady state: AdamW's moments exist from the first step on
        start = time.perf_counter()
        loss, _ = model(batch, torch.full((cfg.loss.unroll_steps,), float(tokens)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # gradients stay allocated, as under DeepSpeed
        seconds.append(time.perf_counter() - start)
    measured = peak_rss() - baseline
    estimate = memory_estimate(cfg, world_size=1, dtype_bytes=4, master_bytes=0)
    gib = 2**30
    print(f"{cfg.model.name} head, {tokens} tokens, vocab {vocab}, fp32, chunk {cfg.loss.chunk_tokens}: "
          f"steps {' / '.join(f'{x:.0f}' for x in seconds)} s, loss {loss.item():.3f}")
    print(f"peak RSS growth {measured / gib:.2f} GiB (weights and optimizer-free state at start "
          f"{(after_weights - baseline) / gib:.2f} GiB)")
    for key, value in estimate.items():
        print(f"  analytic {key:<22} {value / gib:7.2f} GiB")
    print(f"measured / analytic minimum = {measured / estimate['total']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
