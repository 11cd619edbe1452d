"""The training loop: composes target, head, data, losses, DeepSpeed, checkpoints, metrics and export.

One optimizer step on every rank: fetch this rank's `grad_accum` micro batches (a pure function of the step
count), all-reduce their trained-position counts per unroll step (the loss normaliser N_k of the global
batch), then forward/backward/step each micro batch through the DeepSpeed engine. DeepSpeed divides by
grad_accum and averages over ranks, so each micro loss is scaled by world * grad_accum / N_k in
`UnrolledHead`'s normalisers: the gradient is the global token mean, whatever the split.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from infer.engine import Engine
from infer.generate import read_prompt_file
from infer.loader import ModelLoadError
from infer.models.mtp_head import HeadLoadError
from mtp_train import checkpoint, dist
from mtp_train.data import FeatureError, MicroBatches, eval_batches, open_features, split_records, step_token_counts
from mtp_train.heads import HeadConfigError, build_head, shared_tensors_sha256
from mtp_train.metrics import Metrics
from mtp_train.target import TargetError, load_target
from mtp_train.unroll import LossWeights, UnrolledHead
from mtp_train.validate import validate_head

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
KILL_ENV = "MTP_TRAIN_KILL_AFTER_STEP"  # tests: SIGKILL this process right after that optimizer step


class TrainConfigError(ValueError):
    """A trainer setting out of range; the message names the key."""


USER_ERRORS = (TrainConfigError, TargetError, HeadConfigError, FeatureError, checkpoint.ResumeError, HeadLoadError,
               ModelLoadError)


def deepspeed_config(cfg: DictConfig) -> dict:
    t = cfg.trainer
    if t.zero_stage not in (1, 2, 3):
        raise TrainConfigError(f"trainer.zero_stage must be 1, 2 or 3, got {t.zero_stage}")
    if t.dtype not in DTYPES:
        raise TrainConfigError(f"trainer.dtype must be one of {', '.join(DTYPES)}, got {t.dtype!r}")
    return {
        "train_micro_batch_size_per_gpu": 1,  # one packed micro batch per forward; its record count is ours
        "gradient_accumulation_steps": int(t.grad_accum),
        "gradient_clipping": float(t.grad_clip),
        "zero_optimization": {"stage": int(t.zero_stage)},
        "bf16": {"enabled": t.dtype == "bfloat16"},
        "optimizer": {"type": "AdamW", "params": {"lr": float(t.lr), "betas": list(t.betas), "eps": 1e-8,
                                                  "weight_decay": float(t.weight_decay), "torch_adam": True}},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """lr multiplier at scheduler step s: linear warmup to 1, then cosine to min_ratio at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return factor


def param_groups(head: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Only the head's trainable parameters; norms and biases get no weight decay."""
    decay, no_decay = [], []
    for name, param in head.named_parameters():
        if param.requires_grad:
            (no_decay if param.dim() < 2 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


class Trainer:
    def __init__(self, cfg: DictConfig) -> None:
        import deepspeed  # noqa: PLC0415

        self.cfg = cfg
        t = cfg.trainer
        ds_config = deepspeed_config(cfg)
        for key in ("micro_batch_size", "seq_len", "grad_accum", "max_steps"):
            if int(t[key]) < 1:
                raise TrainConfigError(f"trainer.{key} must be >= 1, got {t[key]}")
        self.rank, self.world, self.device = dist.init(str(t.device))
        self.dtype = DTYPES[t.dtype]
        self.out_dir = Path(str(cfg.output_dir))

        # The target's shared tensors: read by name, frozen, once; the head references them.
        self.target = load_target(cfg.model, self.dtype, self.device)
        self.frozen_sha256 = self.frozen_fingerprint()  # compared at the end: the shared tensors never change
        self.head = build_head(self.target, cfg.head, str(cfg.model.path), self.dtype).to(self.device)
        weights = LossWeights(kl=float(cfg.loss.kl), ce=float(cfg.loss.ce), feature=float(cfg.loss.feature),
                              step_decay=float(cfg.loss.step_decay), chunk_tokens=int(cfg.loss.chunk_tokens))
        self.num_steps = int(cfg.loss.unroll_steps)
        self.model = UnrolledHead(self.head, self.target.norm_weight, self.target.eps, self.num_steps, weights)

        dataset = open_features(str(cfg.features_dir), self.target.config.hidden_size)
        train_ids, eval_ids = split_records(len(dataset), int(cfg.eval_records), int(cfg.seed))
        self.micro_batches = MicroBatches(dataset, train_ids, int(t.micro_batch_size), int(t.seq_len), int(cfg.seed),
                                          self.rank, self.world)
        self.eval_set = eval_batches(dataset, eval_ids, int(t.micro_batch_size), int(t.seq_len), self.rank, self.world)

        schedule = warmup_cosine(int(t.warmup_steps), int(t.max_steps), float(t.min_lr_ratio))
        self.engine, _, _, _ = deepspeed.initialize(
            model=self.model, model_parameters=param_groups(self.head, float(t.weight_decay)), config=ds_config,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        )
        self.step = checkpoint.resume(self.engine, t.checkpoint_dir, self.head) if t.resume else 0
        self.served: Engine | None = None  # the target in infer/, for validation (rank 0, loaded on first use)

    # --- one optimizer step ----------------------------------------------------------------------------
    def normalisers(self, batches) -> torch.Tensor:
        counts = sum(step_token_counts(b, self.num_steps) for b in batches)
        counts = dist.all_reduce_sum(counts.to(self.device))
        return counts / (self.world * len(batches))  # DeepSpeed's averaging over ranks and micro batches undone

    def train_step(self) -> dict:
        accum = int(self.cfg.trainer.grad_accum)
        start = time.perf_counter()
        batches = [self.micro_batches(self.step * accum + a) for a in range(accum)]
        norms = self.normalisers(batches)
        totals = torch.zeros(self.num_steps, 4, device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        self.engine.train()
        for batch in batches:
            loss, stats = self.engine(batch.to(self.device, self.dtype), norms)
            self.engine.backward(loss)
            self.engine.step()
            loss_sum += loss.detach().float() / (self.world * accum)
            totals += stats
        self.step += 1
        tokens = torch.tensor(float(sum(b.num_tokens for b in batches)), device=self.device)
        reduced = dist.all_reduce_sum(torch.cat((loss_sum[None], tokens[None], totals.flatten())))
        counts = norms * self.world * accum
        record = {"split": "train", "step": self.step, "loss": reduced[0].item(),
                  "lr": self.engine.get_lr()[0], "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
                  "tokens_per_s": reduced[1].item() / (time.perf_counter() - start),
                  "records": [r for b in batches for r in b.record_ids]}  # this rank's, for the data-order check
        record.update(per_step_means(reduced[2:].view(self.num_steps, 4), counts))
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.engine.eval()
        counts = sum((step_token_counts(b, self.num_steps) for b in self.eval_set), torch.zeros(self.num_steps))
        counts = dist.all_reduce_sum(counts.to(self.device))
        totals, loss = torch.zeros(self.num_steps, 4, device=self.device), torch.zeros((), device=self.device)
        for batch in self.eval_set:
            batch_loss, stats = self.engine(batch.to(self.device, self.dtype), counts)
            totals, loss = totals + stats, loss + batch_loss.float()
        reduced = dist.all_reduce_sum(torch.cat((loss[None], totals.flatten())))
        return {"split": "eval", "step": self.step, "loss": reduced[0].item(),
                **per_step_means(reduced[1:].view(self.num_steps, 4), counts)}

    def validate(self, trainer_top1: float | None) -> dict:
        """The head as infer/ serves it, on rank 0: speculative decoding on held-out prompts (mtp_train.validate).

        Training's top-1 agreement and the runtime's acceptance are logged side by side; a gap over 2 points is
        flagged, since it means training and serving compute different functions (or see different text).
        """
        v = self.cfg.validate
        if not v.enabled:
            return {}
        import deepspeed  # noqa: PLC0415

        # Under ZeRO-3 every rank takes part in gathering the head's full parameters; elsewhere a no-op.
        with deepspeed.zero.GatheredParameters(list(self.head.parameters())):
            if self.rank != 0:
                return {}
            if self.served is None:  # the target through infer/, loaded once, in its serving precision
                dtype = self.dtype if self.device.type == "cuda" else torch.float32
                self.served = Engine.from_pretrained(str(self.cfg.model.path), dtype=dtype, device=str(self.device),
                                                     num_pages=8, max_num_seqs=1)
            prompts = read_prompt_file(Path(str(v.prompts))) if v.prompts else None
            report = validate_head(
                self.served, self.head, prompts, k=int(v.num_draft_tokens), temperatures=tuple(v.temperatures),
                max_new_tokens=int(v.max_new_tokens), batch_size=int(v.batch_size), repeats=int(v.repeats),
                trainer_top1=trainer_top1,
            )
        record = {"split": "validate", "step": self.step, "gap_flag": report["gap_flag"],
                  "greedy_acceptance_0": report["greedy_acceptance_0"], "runtime_kl": report["head_loss"]["kl"]}
        for run in report["runs"]:
            t = f"T{run['temperature']:g}"
            record.update({f"tau_{t}": run["tau"], f"speedup_{t}": run["speedup"],
                           **{f"acceptance_{t}_{j}": a for j, a in enumerate(run["acceptance_per_position"])}})
        return record

    # --- the run ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.trainer
        total, eval_every, save_every = int(t.max_steps), int(t.eval_every), int(t.save_every)
        kill_after = int(os.environ.get(KILL_ENV, -1))
        metrics = Metrics(self.cfg, self.rank, self.step, total, self.out_dir)
        if eval_every and self.step == 0 and self.eval_set:  # the starting point, to measure what training bought
            metrics.log(self.evaluate())
        while self.step < total:
            metrics.log(self.train_step())
            if eval_every and self.eval_set and self.step % eval_every == 0 and self.step < total:
                record = self.evaluate()
                metrics.log(record)
                metrics.log(self.validate(record.get("top1_0")))
            if save_every and self.step % save_every == 0 and self.step < total:
                checkpoint.save(self.engine, t.checkpoint_dir, self.step, self.head)
            if self.step == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
        final_eval = self.evaluate() if self.eval_set else {}
        metrics.log(final_eval)
        metrics.log(self.validate(final_eval.get("top1_0")))
        checkpoint.save(self.engine, t.checkpoint_dir, self.step, self.head)
        head_dir = checkpoint.export_head(self.head, self.out_dir / "head", self.rank, int(t.zero_stage))
        summary = self.summary(final_eval, head_dir)
        metrics.close()
        return summary

    def frozen_fingerprint(self) -> str:
        """Hash of the shared tensors as held in training (in the training dtype)."""
        shared = self.target.shared
        return shared_tensors_sha256(shared.embed_tokens.weight, shared.lm_head.weight)

    def summary(self, final_eval: dict, head_dir: Path) -> dict:
        shared = self.target.shared
        summary = {
            "steps": self.step, "head_dir": str(head_dir), "final_eval": final_eval,
            "trainable_params": sum(p.numel() for g in param_groups(self.head, 0.0) for p in g["params"]),
            "frozen_shared_sha256_start": self.frozen_sha256, "frozen_shared_sha256_end": self.frozen_fingerprint(),
            "frozen_requires_grad": any(p.requires_grad for p in (shared.embed_tokens.weight, shared.lm_head.weight)),
        }
        if self.rank == 0:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary


def per_step_means(sums: torch.Tensor, counts: torch.Tensor) -> dict:
    """sums [K, 4] of (KL, CE, agreement, SmoothL1) and counts [K] -> {kl_0: ..., top1_0: ...}."""
    out = {}
    for k in range(sums.shape[0]):
        n = max(float(counts[k]), 1.0)
        kl, ce, agree, feat = (sums[k] / n).tolist()
        out.update({f"kl_{k}": kl, f"ce_{k}": ce, f"top1_{k}": agree, f"feature_{k}": feat})
    return out
