"""The training loop, composed of typed components: target, head, objective, data, ZeRO, checkpoints, metrics.

One optimizer step on every rank: fetch this rank's `grad_accum` micro batches (a pure function of the step
count), all-reduce their trained-position counts per unroll step (the loss normaliser N_k of the global
batch), then forward/backward/step each micro batch through DeepSpeed (`mtp_train.distributed.ZeroHead`).
DeepSpeed divides by grad_accum and averages over ranks, so each micro loss is scaled by world * grad_accum / N_k
in `UnrolledHead`'s normalisers: the gradient is the global token mean, whatever the split.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from data_tools.config import ConfigError
from infer import parallel
from data_tools.features import FeatureDataset
from infer.engine import Engine
from infer.host_memory import keep_freed_memory
from infer.loader import DTYPES, ModelLoadError
from infer.models.mtp_head import HeadLoadError, save_head, shared_tensors_sha256
from infer.prompts import PromptFileError, read_prompt_file
from mtp_train import checkpoint, distributed, draft_vocab
from mtp_train.config import TrainConfig
from mtp_train.data import FeatureError, MicroBatches, eval_batches, open_features, reaching_every_step, split_records
from mtp_train.block_unroll import BlockObjective
from mtp_train.heads import build_head
from mtp_train.metrics import Metrics, PhaseTimer
from mtp_train.online import OnlineError, OnlineFeatures, check_online, copy_group
from mtp_train.target import TargetError, load_target
from mtp_train.unroll import STATS, LossWeights, UnrolledHead, batch_plan, per_step_means, step_token_counts
from mtp_train.validate import validate_head

USER_ERRORS = (ConfigError, TargetError, FeatureError, checkpoint.ResumeError, HeadLoadError,
               ModelLoadError, PromptFileError, parallel.ShardingError, OnlineError)


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
    """Built from the composed, checked config as its typed object (`OmegaConf.to_object`); `fit` runs it to the
    exported head."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        t = cfg.trainer
        self.rank, self.world, self.device = distributed.init(t.device, t.collective_timeout_s)
        distributed.set_determinism(cfg.seed, t.deterministic, self.device)  # before anything draws a random number
        if self.device.type == "cpu":  # a CPU step's activations, freed and allocated again every step, stay mapped
            keep_freed_memory()
        if t.autocast and not distributed.native_bf16(self.device) and self.rank == 0:
            print(f"warning: trainer.autocast on {self.device}, which has no native bf16 matmuls (no AVX512): they run "
                  "several times slower than fp32 here; trainer.autocast=false trains faster", file=sys.stderr)
        self.dtype = DTYPES[t.dtype]
        self.out_dir = Path(cfg.output_dir)
        self.prompts = read_prompt_file(cfg.validate.prompts) if cfg.validate.prompts else None  # mistakes now

        # The target's shared tensors: read by name, frozen, once; the head references them.
        self.target = load_target(cfg.model, self.dtype, self.device)
        self.frozen_sha256 = self.frozen_fingerprint()  # compared at the end: the shared tensors never change
        self.head = build_head(self.target, cfg.head, cfg.model.path, self.dtype).to(self.device)
        self.num_steps = cfg.loss.unroll_steps
        if cfg.head.architecture == "block":  # B-1 block positions stand for the unroll steps in every report
            self.num_steps = cfg.head.block_size - 1
            self.objective = BlockObjective(self.head, self.target.norm_weight, self.target.eps,
                                            LossWeights.from_config(cfg.loss), cfg.head.anchors_per_record,
                                            cfg.head.gamma, cfg.seed, cfg.head.position_weight,
                                            cfg.head.dpace_alpha)
        else:
            self.objective = UnrolledHead(self.head, self.target.norm_weight, self.target.eps, self.num_steps,
                                          LossWeights.from_config(cfg.loss), autocast=t.autocast)

        dataset = self.open_dataset()
        train_ids, eval_ids = self.long_enough(dataset, *split_records(len(dataset), cfg.eval_records, cfg.seed))
        if isinstance(dataset, OnlineFeatures):  # every rank of a copy computes the whole held-out set alike
            dataset.compute(eval_ids)
        self.draft_vocab = self.choose_draft_vocab(dataset, train_ids, eval_ids)
        self.micro_batches = MicroBatches(dataset, train_ids, t.micro_batch_size, t.seq_len, cfg.seed, self.rank,
                                          self.world, t.pad_tokens_to, cfg.loss.chain_share,
                                          cfg.loss.unroll_steps)
        self.eval_set = eval_batches(dataset, eval_ids, t.micro_batch_size, t.seq_len, self.rank, self.world)
        self.eval_plans = [self.plan(b) for b in self.eval_set]
        self.identity = self.run_identity(dataset)

        self.zero_head = distributed.ZeroHead(self.objective, param_groups(self.head, t.weight_decay),
                                              distributed.deepspeed_config(t),
                                              warmup_cosine(t.warmup_steps, t.max_steps, t.min_lr_ratio))
        self.step = (checkpoint.resume(self.zero_head, t.checkpoint_dir, self.identity, t.resume_ignore_mismatch,
                                       self.rank)
                     if t.resume else 0)
        self.served: Engine | None = None  # the target in infer/, for validation (loaded on first use)
        self.serving = self.serving_group() if cfg.validate.enabled else None
        self.online = dataset if isinstance(dataset, OnlineFeatures) else None

    def open_dataset(self) -> FeatureDataset | OnlineFeatures:
        """The precomputed features (features=offline), or this rank's copy of the target computing them
        (features=online, mtp_train.online): the same records in the same order either way."""
        cfg = self.cfg
        if cfg.features == "offline":
            return open_features(cfg.features_dir, self.target.config.hidden_size, self.head.target_aux_layers)
        check_online(cfg, self.world)
        group = copy_group(cfg.online.tp, self.device)
        online = OnlineFeatures(cfg, group, self.head.target_aux_layers, self.device,
                                cfg.trainer.progress and self.rank == 0)
        if self.rank == 0:
            print(f"online: {self.world // group.size} copies of the target over {group.size} rank(s) each; "
                  f"{online.report.summary()}", file=sys.stderr)
        return online

    def long_enough(self, dataset, train_ids: list[int], eval_ids: list[int]) -> tuple[list[int], list[int]]:
        """Both splits without the records too short to reach every unroll step (`reaching_every_step`), said once."""
        kept = [reaching_every_step(dataset, ids, self.num_steps) for ids in (train_ids, eval_ids)]
        dropped = [len(ids) - len(k) for ids, k in zip((train_ids, eval_ids), kept)]
        if any(dropped) and self.rank == 0:
            source = self.cfg.features_dir or "the data"
            print(f"note: {dropped[0]} training and {dropped[1]} held-out records of {source} have "
                  f"fewer than loss.unroll_steps + 1 = {self.num_steps + 1} tokens: no position of theirs reaches "
                  "every unroll step, so they are left out", file=sys.stderr)
        if not kept[0]:
            raise FeatureError(f"features_dir={self.cfg.features_dir}: none of its {len(train_ids)} training records "
                               f"has loss.unroll_steps + 1 = {self.num_steps + 1} tokens or more")
        return kept[0], kept[1]

    def choose_draft_vocab(self, dataset, train_ids: list[int], eval_ids: list[int]) -> dict:
        """An EAGLE-3 head's draft vocabulary by head.draft_vocab_rule (mtp_train.draft_vocab), and the probability
        mass both rules cover at that size, on the training records it is chosen from and on the held-out ones.
        Every rank computes the same ids from the same records."""
        h = self.cfg.head
        size = self.head.config.draft_vocab_size
        if self.head.config.architecture != "eagle3" or size is None or size == self.head.config.vocab_size:
            return {}
        scores = draft_vocab.token_scores(dataset, train_ids, self.target, h.draft_vocab_tokens)
        held_out = draft_vocab.token_scores(dataset, eval_ids, self.target, h.draft_vocab_tokens)
        chosen = {rule: draft_vocab.choose(scores, size, rule) for rule in draft_vocab.RULES}
        self.head.set_draft_vocab(chosen[h.draft_vocab_rule])
        self.head.share_lm_head_rows()
        return {"size": size, "rule": h.draft_vocab_rule, "train_positions": scores.positions,
                "eval_positions": held_out.positions,
                **{f"mass_{rule}_train": round(draft_vocab.coverage(scores, ids), 5) for rule, ids in chosen.items()},
                **{f"mass_{rule}_eval": round(draft_vocab.coverage(held_out, ids), 5) for rule, ids in chosen.items()}}

    def run_identity(self, dataset: FeatureDataset | OnlineFeatures) -> dict:
        """What decides the data order and the objective; a resumed run must match it (mtp_train.checkpoint).
        Online, the features' identity is the target's files, the settings of its forward and the records."""
        cfg, t = self.cfg, self.cfg.trainer
        if isinstance(dataset, OnlineFeatures):
            features = dataset.identity
        else:
            shards = json.dumps([s["sha256"] for s in dataset.manifest["shards"]]).encode()
            features = {"num_records": dataset.manifest["num_records"],
                        "shards_sha256": hashlib.sha256(shards).hexdigest()}
        return {
            "target": self.head.config.target,
            "features": features,
            "seed": cfg.seed, "eval_records": cfg.eval_records, "world_size": self.world,
            "micro_batch_size": t.micro_batch_size, "seq_len": t.seq_len, "grad_accum": t.grad_accum,
            "head": asdict(self.head.config) | {"target": None},
            "loss": asdict(cfg.loss),
        }

    # --- one optimizer step ----------------------------------------------------------------------------
    def plan(self, batch):
        """A micro batch's index plan: the unroll's, or the block head's anchors."""
        if isinstance(self.objective, BlockObjective):
            return self.objective.plan(batch)
        return batch_plan(batch, self.num_steps)

    def counts(self, batch, plan) -> torch.Tensor:
        """[num_steps] trained positions per step (block: per block position) of a planned micro batch."""
        if isinstance(self.objective, BlockObjective):
            return self.objective.counts(batch, plan)
        return step_token_counts(batch, plan, self.num_steps)

    def normalisers(self, batches, plans) -> torch.Tensor:
        counts = sum(self.counts(b, plan) for b, plan in zip(batches, plans))
        counts = distributed.all_reduce_sum(counts.to(self.device))
        return counts / (self.world * len(batches))  # DeepSpeed's averaging over ranks and micro batches undone

    def train_step(self) -> dict:
        accum = self.cfg.trainer.grad_accum
        start = time.perf_counter()
        phases = PhaseTimer(self.device, self.cfg.trainer.time_phases)
        batches = [self.micro_batches(self.step * accum + a) for a in range(accum)]
        phases.lap("data_s")  # online: the target's forwards (target_forward_s of them); offline: reading features
        plans = [self.plan(b) for b in batches]  # once per micro batch: counted, then unrolled
        norms = self.normalisers(batches, plans)
        totals = torch.zeros(self.num_steps, len(STATS), device=self.device)
        loss_sum = torch.zeros((), device=self.device)
        self.zero_head.train()
        phases.lap("data_s")
        for batch, plan in zip(batches, plans):
            loss, stats = self.zero_head(batch.to(self.device, self.dtype), norms, plan)
            self.zero_head.backward(loss)
            phases.lap("head_s")
            self.zero_head.step()
            phases.lap("optimizer_s")
            loss_sum += loss.detach().float() / (self.world * accum)
            totals += stats
        self.step += 1
        tokens = torch.tensor(float(sum(b.record_tokens for b in batches)), device=self.device)
        reduced = distributed.all_reduce_sum(torch.cat((loss_sum[None], tokens[None], totals.flatten())))
        counts = norms * self.world * accum
        record = {"split": "train", "step": self.step, "loss": reduced[0].item(), "lr": self.zero_head.lr,
                  "grad_norm": self.zero_head.grad_norm, "tokens": reduced[1].item(),
                  "tokens_per_s": reduced[1].item() / (time.perf_counter() - start),
                  "records": [r for b in batches for r in b.record_ids]}  # this rank's, for the data-order check
        if self.online:  # this rank's seconds in the target's forwards so far, and its records computed so far
            record.update(target_forward_s=self.online.forward_s, target_records=self.online.records_computed)
        record.update(phases.seconds)
        record.update(per_step_means(reduced[2:].view(self.num_steps, len(STATS)), counts))
        if self.cfg.loss.chain_share < 1 and self.num_steps > 1:  # the share drawn: step 1's positions over step 0's
            record["chain_share"] = float(counts[1] / counts[0].clamp(min=1))
        return record

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.zero_head.eval()
        counts = sum((self.counts(b, plan) for b, plan in zip(self.eval_set, self.eval_plans)),
                     torch.zeros(self.num_steps))
        counts = distributed.all_reduce_sum(counts.to(self.device))
        totals, loss = torch.zeros(self.num_steps, len(STATS), device=self.device), torch.zeros((), device=self.device)
        for batch, plan in zip(self.eval_set, self.eval_plans):
            batch_loss, stats = self.zero_head(batch.to(self.device, self.dtype), counts, plan)
            totals, loss = totals + stats, loss + batch_loss.float()
        reduced = distributed.all_reduce_sum(torch.cat((loss[None], totals.flatten())))
        return {"split": "eval", "step": self.step, "loss": reduced[0].item(),
                **per_step_means(reduced[1:].view(self.num_steps, len(STATS)), counts)}

    def serving_group(self) -> parallel.TPGroup:
        """The first validate.tp ranks, which serve the target (each its 1/tp shard, beside its ZeRO share of the
        head) for validation; the other replicas of that size skip it. Every rank makes every replica's group."""
        tp = self.cfg.validate.tp
        with parallel.sharding_over(parallel.current()):  # the served target shards; training's modules stay whole
            return parallel.init_tp(tp, self.device, replicas=True, option=f"validate.tp={tp}")

    def validate(self) -> dict:
        """The head as infer/ serves it, on the serving group (rank 0 alone at validate.tp=1): speculative decoding
        on held-out prompts (mtp_train.validate), driven by rank 0 while the group's other ranks serve its steps.

        Its report puts the trainer's per-step top-1 on the text the runtime produced beside the runtime's
        conditional acceptance; a gap over 2 points at a position is flagged (training and serving would compute
        different functions).
        """
        v = self.cfg.validate
        if not v.enabled:
            return {}
        with self.zero_head.gathered(list(self.head.parameters())):  # every rank takes part under ZeRO-3
            if self.serving.replica != 0:
                return {}
            with parallel.sharding_over(self.serving):  # the target and the served copy of the head: 1/tp each
                if self.served is None:  # the target through infer/, loaded once, in its serving precision
                    dtype = self.dtype if self.device.type == "cuda" else torch.float32
                    self.served = Engine.from_pretrained(self.cfg.model.path, dtype=dtype, device=str(self.device),
                                                         num_pages=8, max_num_seqs=1)
                report = validate_head(
                    self.served, self.head, self.prompts, k=v.num_draft_tokens, temperatures=tuple(v.temperatures),
                    max_new_tokens=v.max_new_tokens, batch_size=v.batch_size, repeats=v.repeats,
                    recommend_for=(),  # the K recommendation is the final, standalone validation's
                    ideal=False,  # the record logs no ideal speedup: its forward-cost timing would be most forwards
                )
        if report is None:  # a serving rank > 0: it ran rank 0's steps on its shards
            return {}
        record = {"split": "validate", "step": self.step, "validate_tp": report["tp"], "gap_flag": report["gap_flag"]}
        replay = report["trainer_replay"] or {}
        record.update({f"replay_cond_top1_{j}": a for j, a in enumerate(replay.get("at_verify_steps", []))})
        for run in report["runs"]:
            t = f"T{run['temperature']:g}"
            record.update({f"tau_{t}": run["tau"], f"speedup_{t}": run["speedup"],
                           **{f"acceptance_{t}_{j}": a for j, a in enumerate(run["conditional_acceptance"])}})
        return record

    def save_checkpoint(self) -> None:
        checkpoint.save(self.zero_head, self.cfg.trainer.checkpoint_dir, self.step, self.identity, self.rank)

    def save_trained_head(self) -> Path:
        """infer's head folder in output_dir/head (collective under ZeRO-3: parameters gathered on every rank)."""
        out = self.out_dir / "head"
        with self.zero_head.gathered(list(self.head.parameters())):
            if self.rank == 0:
                save_head(self.head, out)  # replaces this run's own head from an earlier try, nothing else
        distributed.barrier()
        return out

    # --- the run ------------------------------------------------------------------------------------------
    def fit(self) -> dict:
        t = self.cfg.trainer
        metrics = Metrics(self.cfg, self.rank, self.step, t.max_steps, self.out_dir)
        if self.draft_vocab:
            metrics.log({"split": "draft_vocab", "step": self.step, **self.draft_vocab})
        if t.eval_every and self.step == 0 and self.eval_set:  # the starting point, to measure what training bought
            metrics.log(self.evaluate())
        while self.step < t.max_steps:
            metrics.log(self.train_step())
            if t.eval_every and self.eval_set and self.step % t.eval_every == 0 and self.step < t.max_steps:
                record = self.evaluate()
                metrics.log(record)
                metrics.log(self.validate())
            if t.save_every and self.step % t.save_every == 0 and self.step < t.max_steps:
                self.save_checkpoint()
        final_eval = self.evaluate() if self.eval_set else {}
        metrics.log(final_eval)
        metrics.log(self.validate())
        self.save_checkpoint()
        summary = self.summary(final_eval, self.save_trained_head())
        metrics.close()
        return summary

    def frozen_fingerprint(self) -> str:
        """Hash of the shared tensors as held in training (in the training dtype)."""
        shared = self.target.shared
        return shared_tensors_sha256(shared.embed_tokens.weight, shared.lm_head.weight)

    def summary(self, final_eval: dict, head_dir: Path) -> dict:
        shared = self.target.shared
        summary = {
            "steps": self.step, "head_dir": str(head_dir), "final_eval": final_eval, "draft_vocab": self.draft_vocab,
            "trainable_params": sum(p.numel() for g in param_groups(self.head, 0.0) for p in g["params"]),
            "frozen_shared_sha256_start": self.frozen_sha256, "frozen_shared_sha256_end": self.frozen_fingerprint(),
            "frozen_requires_grad": any(p.requires_grad for p in (shared.embed_tokens.weight, shared.lm_head.weight)),
            # this rank's peak of device memory (a GPU's allocator; None on a CPU)
            "peak_device_bytes": torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None,
        }
        if self.rank == 0:
            (self.out_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        return summary
