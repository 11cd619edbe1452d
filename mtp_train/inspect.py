"""Parameter counts and the memory per GPU of a head training config, without loading any weights.

    python -m mtp_train.inspect [--gpus 8] model=llama3_1_70b [head=eagle1|eagle3] [trainer=zero3] [key=value ...]

The head is built on the meta device from the target's shapes (its config.json when model.path has one, else
the shapes in conf/model/*.yaml). Memory per GPU, for one micro batch:
  trainable weights      P x dtype bytes                  (ZeRO-3: / GPUs)
  gradients              P x dtype bytes                  (ZeRO-2/3: / GPUs)
  optimizer state        P x (fp32 master if bf16 + 8)    (ZeRO-1/2/3: / GPUs): AdamW's two fp32 moments
  frozen shared          vocab x hidden x (1 tied, 2 untied) x dtype bytes, on every GPU
  activations            tokens x K unroll steps x (tensors autograd keeps per token) x dtype bytes
  loss chunk             2 x chunk_tokens x draft vocab x 4: the head's q and the target's p of one chunk (fp32)
  target distribution    tokens x (draft vocab x dtype bytes + 12): p of every position, computed once per micro
                         batch and read by every unroll step (mtp_train.losses.target_distribution)
"""

from __future__ import annotations

import argparse
import sys

import torch
from omegaconf import DictConfig
from torch import nn

from infer.models.common import RMSNorm
from infer.models.mtp_head import DraftHead, head_module
from mtp_train.config import compose_training
from mtp_train.heads import head_config
from mtp_train.target import target_config


def meta_head(cfg: DictConfig) -> DraftHead:
    config = target_config(cfg.model, need_weights=False)
    with torch.device("meta"):
        return head_module(head_config(config, cfg.head, {"name": str(cfg.model.name)}))


def parameter_counts(cfg: DictConfig) -> dict[str, int]:
    head = meta_head(cfg)
    config = head.config
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    tied = bool(getattr(target_config(cfg.model, need_weights=False), "tie_word_embeddings", False))
    shared = config.vocab_size * config.hidden_size * (1 if tied else 2)
    projection = head.fc if config.architecture == "eagle3" else head.eh_proj
    own_rows = head.lm_head if getattr(head, "lm_head", None) is not None else nn.Identity()
    return {
        "trainable": count(head), "decoder_layer": count(head.layer), "projection": count(projection),
        "norms": count(head) - count(head.layer) - count(projection) - count(own_rows), "lm_head_rows": count(own_rows),
        "frozen_shared": shared,
    }


def activation_elements_per_token(head: DraftHead, feature_loss: bool) -> int:
    """Elements autograd keeps per token and unroll step: every Linear's and RMSNorm's input, attention's
    q/k/v, the gated MLP's gate/up output and activation, the fused loss's grad_x, and (when weighted)
    SmoothL1's two inputs. Exact for Llama layers; for MLA an approximation (an input shared by two Linears
    counts twice)."""
    hidden = head.config.hidden_size
    total = hidden + (2 * hidden if feature_loss else 0)  # grad_x [T, H]; SmoothL1's head and target states
    for module in head.modules():
        if isinstance(module, nn.Linear):
            total += module.in_features
        elif isinstance(module, RMSNorm):
            total += module.weight.shape[0]
    dims = head.attention_dims()
    if dims["mla_dims"] is None:
        total += dims["num_heads"] * dims["head_dim"] + 2 * dims["num_kv_heads"] * dims["head_dim"]
    else:
        rank, rope = dims["mla_dims"]
        total += dims["num_heads"] * (rank + rope) + (rank + rope) + rank
    inter = head.config.decoder_config().intermediate_size
    return total + 3 * inter  # gate/up output (2I) and the activation (I)


def memory_estimate(cfg: DictConfig, world_size: int, dtype_bytes: int | None = None,
                    master_bytes: int | None = None) -> dict[str, float]:
    """Bytes per GPU by category (see the module docstring)."""
    t = cfg.trainer
    dtype_bytes = dtype_bytes or (2 if t.dtype == "bfloat16" else 4)
    master_bytes = (4 if dtype_bytes == 2 else 0) if master_bytes is None else master_bytes
    counts = parameter_counts(cfg)
    head = meta_head(cfg)
    stage, n = t.zero_stage, world_size
    p = counts["trainable"]
    tokens = t.micro_batch_size * t.seq_len
    draft_vocab = head.config.draft_vocab_size or head.config.vocab_size
    out = {
        "trainable_weights": p * dtype_bytes / (n if stage == 3 else 1),
        "gradients": p * dtype_bytes / (n if stage >= 2 else 1),
        "optimizer_state": p * (master_bytes + 8) / n,
        "frozen_shared": counts["frozen_shared"] * dtype_bytes,
        "activations": tokens * cfg.loss.unroll_steps * dtype_bytes
        * activation_elements_per_token(head, cfg.loss.feature != 0),
        "loss_chunk": 2 * min(cfg.loss.chunk_tokens, tokens) * draft_vocab * 4,
        "target_distribution": tokens * (draft_vocab * dtype_bytes + 12),  # p [T, Vd], argmax and sum p log p
    }
    out["total"] = sum(out.values())
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.inspect", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for mtp_train.train")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs the ZeRO state is split over")
    args = parser.parse_args(argv)
    cfg = compose_training(args.overrides, complete=False)
    counts = parameter_counts(cfg)
    t = cfg.trainer
    print(f"{cfg.model.name} / {cfg.head.architecture} head")
    for key, value in counts.items():
        print(f"  {key:<16} {value:>15,}  ({value / 1e9:.3f} B)")
    print(f"memory per GPU: ZeRO-{t.zero_stage}, {t.dtype}, {args.gpus} GPUs, micro batch {t.micro_batch_size} x "
          f"{t.seq_len} tokens, {cfg.loss.unroll_steps} unroll step(s), loss chunk {cfg.loss.chunk_tokens}")
    for key, value in memory_estimate(cfg, args.gpus).items():
        print(f"  {key:<18} {value / 2**30:8.2f} GiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
