"""Parameter counts and the memory per GPU of a head training config, without loading any weights.

    python -m mtp_train.memory_plan [--gpus 8] model=llama3_1_70b [head=eagle1|eagle3] [trainer=zero3] [key=value ...]
    python -m mtp_train.memory_plan --all-models [--gpus 8 --gpu-gib 80]   # the tensor-parallel plan of every config

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

The tensor-parallel plan: per GPU, for the smallest TP degree T (of the GPUs' divisors that split the target's
heads, features and vocabulary) that fits in the GPU's memory less 10% headroom (CUDA context, NCCL buffers,
fragmentation), the target served in bf16 (--serve-dtype), counted from the sharded model built on the meta device:
  precompute (conf/precompute.yaml's batch; GPUs / T replicas)
    target shard         this rank's parameters x dtype bytes ((all - replicated norms) / T + norms)
    kv pages             (pages for max_tokens_per_batch + max_records_per_batch) x page x KV bytes per token / T
    activations          max_tokens_per_batch x (the residual stream, its normed copy and every Linear output of a
                         decoder layer on this rank, routed experts by their share of tokens; plus the returned
                         last and aux layers' states) x dtype bytes
    shard buffers        max_tokens_per_batch x hidden x (1 + aux layers) x stored dtype bytes (before the copy out)
  validation in training (the first T trainer ranks; mtp_train.validate's engines for `validate`'s batch)
    target shard, head shard (the served copy), gathered head (ZeRO-3: the whole trainable head, training dtype),
    kv pages (the target in the plain and speculative engines, the head's, the served engine's 8 pages; prompts of
    --prompt-tokens), activations (the loss recomputation: target and head logits, their fp32 log-softmaxes and p
    over prompt + max_new_tokens positions, and its attention scores)
  online training (features=online; GPUs / T copies of the target, mtp_train.online)
    head ZeRO share (training's weights, gradients, optimizer state, frozen tensors), target shard, kv pages (one
    capture batch: pages for online.max_tokens_per_batch + online.max_records_per_batch), the forward's activations
    (as precompute's) or training's activations + loss chunk + target distribution, whichever is larger, and the
    features of the copy's T ranks' micro batches (T x micro batch x seq_len x hidden x (1 + aux layers))
  peak in training       training's weights, gradients, optimizer state and frozen tensors, plus the larger of
                         training's activations + loss chunk and validation (the allocator reuses freed memory)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch
from omegaconf import DictConfig
from torch import nn
from transformers import PretrainedConfig

from data_tools.config import CONF_DIR, DTYPE_NAMES, compose
from infer.bench.speedup import timing_context
from infer.cli import run_cli
from infer.engine import EngineConfig
from infer.kv_cache import pages_needed
from infer.loader import DTYPES, build_on_meta
from infer.models.common import RMSNorm
from infer.models.mtp_head import DraftHead, head_module
from infer.parallel import ShardingError, TPGroup, divisors, sharding_over
from mtp_train.config import compose_training
from mtp_train.heads import head_config
from mtp_train.target import target_config

GIB = 2**30
HEADROOM = 0.10
SERVED_ENGINE_PAGES = 8  # the trainer's served engine (mtp_train.trainer), beside validation's own


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


# --- the tensor-parallel plan ------------------------------------------------------------------------------
@dataclass
class StagePlan:
    """Bytes per GPU of one stage at TP degree `tp` (None: no degree fits; the terms are then the largest tried)."""

    stage: str
    tp: int | None
    terms: dict[str, float]
    total: float  # the peak: the sum of the terms, but for validation in training (module docstring)
    budget: float

    @property
    def fits(self) -> bool:
        return self.tp is not None and self.total <= self.budget


@dataclass
class Served:
    """What one rank of a TP group holds of the target and of the served head, built on the meta device."""

    config: PretrainedConfig
    target: nn.Module
    head: DraftHead
    target_params: int  # this rank's (tied embeddings once)

    @classmethod
    def build(cls, cfg: DictConfig, tp: int) -> "Served":
        config = target_config(cfg.model, need_weights=False)
        group = TPGroup(rank=0, size=tp)
        target = build_on_meta(config, group)  # ShardingError when tp does not split it
        with sharding_over(group), torch.device("meta"):
            head = head_module(head_config(config, cfg.head, {"name": str(cfg.model.name)}))
        tied = getattr(config, "tie_word_embeddings", False)
        params = sum(p.numel() for p in target.parameters()) - (target.lm_head.weight.numel() if tied else 0)
        return cls(config, target, head, params)

    def forward_elements_per_token(self) -> float:
        """Elements this rank holds per token at a decoder layer's peak (module docstring)."""
        config = self.config
        experts = getattr(config, "n_routed_experts", None)
        share = config.num_experts_per_tok / experts if experts else 1.0  # the tokens each routed expert sees

        def layer(module: nn.Module) -> float:
            return 2 * config.hidden_size + sum(m.out_features * (share if ".experts." in f".{name}." else 1.0)
                                                for name, m in module.named_modules() if isinstance(m, nn.Linear))

        return max(layer(module) for module in self.target.model.layers)


def precompute_terms(cfg: DictConfig, pc: DictConfig, tp: int, dtype: torch.dtype) -> dict[str, float]:
    served = Served.build(cfg, tp)
    hidden, tokens, page, aux = served.config.hidden_size, pc.max_tokens_per_batch, pc.page_size, len(pc.aux_layers)
    pages = pages_needed(tokens, page) + pc.max_records_per_batch  # data_tools.precompute.FeatureExtractor's pool
    return {
        "target_shard": served.target_params * dtype.itemsize,
        "kv_pages": pages * page * served.target.kv_bytes_per_token(dtype),
        "activations": tokens * (served.forward_elements_per_token() + hidden * (1 + aux)) * dtype.itemsize,
        "shard_buffers": tokens * hidden * (1 + aux) * DTYPES[pc.dtype].itemsize,
    }


def online_terms(cfg: DictConfig, tp: int) -> dict[str, float]:
    """features=online (mtp_train.online): this rank's shard of the target, the KV pool of one capture batch (the
    extractor's pages for online.max_tokens_per_batch), the forward's activations over that batch, and the states
    kept for the micro batches of the copy's tp ranks (every rank of a copy holds them all)."""
    o, t = cfg.online, cfg.trainer
    served, dtype = Served.build(cfg, tp), DTYPES[cfg.online.model_dtype]
    hidden, tokens = served.config.hidden_size, o.max_tokens_per_batch
    pages = pages_needed(tokens, o.page_size) + o.max_records_per_batch  # data_tools.precompute.FeatureExtractor's pool
    layers = 1 + len(served.head.target_aux_layers)
    return {
        "target_shard": served.target_params * dtype.itemsize,
        "kv_pages": pages * o.page_size * served.target.kv_bytes_per_token(dtype),
        "forward_activations": tokens * (served.forward_elements_per_token() + hidden * layers) * dtype.itemsize,
        "features": tp * t.micro_batch_size * t.seq_len * hidden * layers * DTYPES[o.dtype].itemsize,
    }


def validation_terms(cfg: DictConfig, tp: int, dtype: torch.dtype, prompt_tokens: int) -> dict[str, float]:
    v = cfg.validate
    served = Served.build(cfg, tp)
    page = EngineConfig().page_size
    n = prompt_tokens + v.max_new_tokens
    longest = timing_context(n, v.num_draft_tokens, EngineConfig().decode_run_steps)
    pages = v.batch_size * pages_needed(longest, page) + 1  # as mtp_train.validate sizes them
    kv = served.target.kv_bytes_per_token(dtype)
    heads = served.target.attention_dims()["num_heads"]
    return {
        "target_shard": served.target_params * dtype.itemsize,
        "head_shard": sum(p.numel() for p in served.head.parameters()) * dtype.itemsize,
        "gathered_head": (parameter_counts(cfg)["trainable"] * DTYPES[cfg.trainer.dtype].itemsize
                          if cfg.trainer.zero_stage == 3 else 0),
        "kv_pages": ((2 * pages + SERVED_ENGINE_PAGES) * kv + pages * served.head.kv_bytes_per_token(dtype)) * page,
        "activations": n * served.config.vocab_size * (2 * dtype.itemsize + 12) + n * n * heads * 4,
    }


def smallest_fitting(stage: str, degrees: list[int], budget: float, plan_at) -> StagePlan:
    """The plan at the smallest degree that fits (degrees that do not split the model are skipped)."""
    plan = StagePlan(stage, None, {}, 0.0, budget)
    for tp in degrees:
        try:
            plan = plan_at(tp)
        except ShardingError:
            continue
        if plan.fits:
            return plan
    plan.tp = None
    return plan


def tp_plan(cfg: DictConfig, gpus: int = 8, gpu_bytes: float = 80 * GIB, serve_dtype: str = "bfloat16",
            prompt_tokens: int = 1024, precompute_overrides: list[str] | None = None) -> dict[str, StagePlan]:
    """Per GPU: precompute and validation in training at their smallest fitting TP degree, validation at the
    configured validate.tp, and training (module docstring)."""
    budget, dtype, degrees = gpu_bytes * (1 - HEADROOM), DTYPES[serve_dtype], divisors(gpus)
    pc = compose("precompute", precompute_overrides or [], complete=False).precompute
    training = memory_estimate(cfg, gpus)
    transient = training["activations"] + training["loss_chunk"]
    state = {k: training[k] for k in ("trainable_weights", "gradients", "optimizer_state", "frozen_shared")}

    def precompute_at(tp: int) -> StagePlan:
        terms = precompute_terms(cfg, pc, tp, dtype)
        return StagePlan(f"precompute ({gpus // tp} replicas)", tp, terms, sum(terms.values()), budget)

    def validation_at(tp: int) -> StagePlan:
        terms = validation_terms(cfg, tp, dtype, prompt_tokens)
        peak = sum(state.values()) + max(transient, sum(terms.values()))
        return StagePlan("validation in training", tp, {"training_state": sum(state.values()), **terms}, peak, budget)

    def online_at(tp: int) -> StagePlan:  # the forward's activations and training's are never live together
        terms = online_terms(cfg, tp)
        peak = (sum(state.values()) + terms["target_shard"] + terms["kv_pages"] + terms["features"]
                + max(terms["forward_activations"], transient + training["target_distribution"]))
        return StagePlan(f"online training ({gpus // tp} copies)", tp,
                         {"head_zero_share": sum(state.values()), **terms,
                          "training_activations": transient + training["target_distribution"]}, peak, budget)

    plans = {"precompute": smallest_fitting("precompute", degrees, budget, precompute_at),
             "online": smallest_fitting("online training", degrees, budget, online_at),
             "validation": smallest_fitting("validation in training", degrees, budget, validation_at)}
    configured = int(cfg.validate.tp)
    if configured != plans["validation"].tp:
        plans["validation_configured"] = validation_at(configured)
        plans["validation_configured"].stage = "validation at validate.tp"
    if int(cfg.online.tp) != plans["online"].tp:
        plans["online_configured"] = online_at(int(cfg.online.tp))
        plans["online_configured"].stage = "online at online.tp"
    plans["training"] = StagePlan("training (data-parallel)", 1, {k: v for k, v in training.items() if k != "total"},
                                  training["total"], budget)
    return plans


def print_plan(cfg: DictConfig, plans: dict[str, StagePlan], gpus: int, gpu_bytes: float, serve_dtype: str) -> None:
    print(f"{cfg.model.name}: GiB per GPU on {gpus} x {gpu_bytes / GIB:g} GiB ({gpu_bytes * (1 - HEADROOM) / GIB:.1f} "
          f"usable), target in {serve_dtype}, ZeRO-{cfg.trainer.zero_stage} {cfg.trainer.dtype} head")
    for plan in plans.values():
        degree = "no tp fits" if plan.tp is None else f"tp={plan.tp}"
        terms = ", ".join(f"{name.replace('_', ' ')} {value / GIB:.2f}" for name, value in plan.terms.items())
        print(f"  {plan.stage:<28} {degree:<10} {plan.total / GIB:7.2f}  {'fits' if plan.fits else 'DOES NOT FIT'}"
              f"  ({terms})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.memory_plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, as for mtp_train.train")
    parser.add_argument("--gpus", type=int, default=8, help="data-parallel GPUs the ZeRO state is split over")
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU in GiB (default 80)")
    parser.add_argument("--serve-dtype", choices=DTYPE_NAMES, default="bfloat16",
                        help="the target's dtype in precompute and validation (default bfloat16)")
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="validation prompts' length (default 1024)")
    parser.add_argument("--all-models", action="store_true", help="the tensor-parallel plan of every conf/model config")
    args = parser.parse_args(argv)
    gpu_bytes = args.gpu_gib * GIB
    if args.all_models:
        for name in sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")):
            cfg = compose_training([f"model={name}", *args.overrides], complete=False)
            print_plan(cfg, tp_plan(cfg, args.gpus, gpu_bytes, args.serve_dtype, args.prompt_tokens, [f"model={name}"]),
                       args.gpus, gpu_bytes, args.serve_dtype)
        return 0
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
    models = [o for o in args.overrides if o.startswith("model=")]
    print_plan(cfg, tp_plan(cfg, args.gpus, gpu_bytes, args.serve_dtype, args.prompt_tokens, models), args.gpus,
               gpu_bytes, args.serve_dtype)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
