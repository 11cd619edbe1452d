"""The typed schema of head training (conf/config.yaml), on the model and data schemas of `data_tools.config`.

Hydra checks each value's type while composing; `data_tools.config.check` tests the ranges in field metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig

from data_tools.config import DTYPE_NAMES, ConfigError, DataConfig, HeadConfig, ModelConfig, at_least, compose, one_of


@dataclass
class LossConfig:
    kl: float = field(default=1.0, metadata=at_least(0.0))
    ce: float = field(default=0.0, metadata=at_least(0.0))
    feature: float = field(default=0.0, metadata=at_least(0.0))
    tv: float = field(default=0.0, metadata=at_least(0.0))
    unroll_steps: int = field(default=4, metadata=at_least(1, max=16))
    step_decay: float = field(default=0.8, metadata=at_least(0.0, max=1.0))
    # steps 1..K-1 train on a random window of this share of each record's anchors; step 0 on all of them
    chain_share: float = field(default=1.0, metadata=at_least(0.0, max=1.0))
    chunk_tokens: int = field(default=512, metadata=at_least(1))


@dataclass
class TrainerConfig:
    zero_stage: int = field(default=2, metadata=one_of(1, 2, 3))
    dtype: str = field(default="bfloat16", metadata=one_of("bfloat16", "float32"))
    autocast: bool = False  # with dtype float32: the head's linear layers in bf16 (torch.autocast), the rest fp32
    micro_batch_size: int = field(default=1, metadata=at_least(1))
    seq_len: int = field(default=4096, metadata=at_least(1))
    grad_accum: int = field(default=1, metadata=at_least(1))
    lr: float = field(default=1e-4, metadata=at_least(0.0))
    min_lr_ratio: float = field(default=0.1, metadata=at_least(0.0, max=1.0))
    warmup_steps: int = field(default=0, metadata=at_least(0))
    max_steps: int = field(default=1000, metadata=at_least(1))
    weight_decay: float = field(default=0.0, metadata=at_least(0.0))
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = field(default=1.0, metadata=at_least(0.0))
    eval_every: int = field(default=200, metadata=at_least(0))
    save_every: int = field(default=500, metadata=at_least(0))
    checkpoint_dir: str = MISSING
    resume: bool = True
    resume_ignore_mismatch: bool = False  # resume a checkpoint whose run.json differs from this run (named fields)
    device: str = field(default="auto", metadata=one_of("auto", "cpu", "cuda"))
    deterministic: bool = False  # CUDA: deterministic kernels, bitwise-equal runs (CPU runs are without it)
    # a collective waiting this long on a peer fails the job (a rank that died on another node); covers the
    # longest one-rank stretch (rank 0's validation and checkpoint hashing while the others wait)
    collective_timeout_s: float = field(default=1800.0, metadata=at_least(1.0))
    progress: bool = True
    log_every: int = field(default=10, metadata=at_least(1))
    # the step's split logged (target_s, head_s: forward and backward, optimizer_s), the device synchronised
    # between the phases (on a GPU that costs the overlap of the host's launches with the kernels)
    time_phases: bool = False
    pad_tokens_to: int = field(default=256, metadata=at_least(1))  # a micro batch's tokens: a multiple (data.pad_tokens)


@dataclass
class ValidateConfig:
    enabled: bool = True
    tp: int = field(default=1, metadata=at_least(1))  # trainer ranks serving the target together; divides them
    num_draft_tokens: int = field(default=4, metadata=at_least(1, max=16))
    max_new_tokens: int = field(default=128, metadata=at_least(1))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    batch_size: int = field(default=16, metadata=at_least(1))
    repeats: int = field(default=1, metadata=at_least(1))
    prompts: Optional[str] = None  # JSONL prompts; null: infer.prompts.VALIDATION_PROMPTS (64 held-out openings)


@dataclass
class OnlineConfig:
    """features=online: the target computes each micro batch's features inside the job (mtp_train.online)."""
    tp: int = field(default=1, metadata=at_least(1, max=64))  # ranks per copy of the target; W / tp copies
    dtype: str = field(default="bfloat16", metadata=one_of(*DTYPE_NAMES))  # features rounded as precompute stores them
    model_dtype: str = field(default="float32", metadata=one_of(*DTYPE_NAMES))  # the target's forward
    max_tokens_per_batch: int = field(default=8192, metadata=at_least(1))  # one packed prefill (a longer record alone)
    max_records_per_batch: int = field(default=256, metadata=at_least(1))
    attention_backend: str = field(default="auto", metadata=one_of("auto", "torch", "flashinfer"))
    page_size: int = field(default=16, metadata=at_least(1))


@dataclass
class WandbConfig:
    mode: str = field(default="disabled", metadata=one_of("disabled", "offline", "online"))
    project: str = "mtp-heads"
    name: Optional[str] = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    head: HeadConfig = field(default_factory=HeadConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    features: str = field(default="offline", metadata=one_of("offline", "online"))  # online: no feature store
    features_dir: Optional[str] = None  # features=offline: output_dir of data_tools.precompute
    online: OnlineConfig = field(default_factory=OnlineConfig)
    output_dir: str = MISSING
    eval_records: int = field(default=16, metadata=at_least(0))
    seed: int = 0
    loss: LossConfig = field(default_factory=LossConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


ConfigStore.instance().store(name="train_schema", node=TrainConfig)


def compose_training(overrides: list[str], complete: bool = True) -> DictConfig:
    """conf/config.yaml with overrides, typed and checked (ConfigError naming the key)."""
    cfg = compose("config", overrides, complete)
    check_training(cfg, complete)
    return cfg


def check_training(cfg: DictConfig, complete: bool = True) -> None:
    """The rules between fields that the schema's per-field ranges cannot state (complete=False: a config read for
    its shapes, as memory_plan reads it, needs no features)."""
    if cfg.trainer.autocast and cfg.trainer.dtype != "float32":
        raise ConfigError("trainer.autocast runs the head's linear layers in bf16 over fp32 weights: it needs "
                          f"trainer.dtype=float32, got {cfg.trainer.dtype}")
    if complete and cfg.features == "offline" and not cfg.features_dir:
        raise ConfigError("features_dir is not set: give the output_dir of python -m data_tools.precompute, or train "
                          "with features=online (the target computes the features in the job)")
    if cfg.trainer.seq_len <= cfg.loss.unroll_steps:
        raise ConfigError(f"trainer.seq_len={cfg.trainer.seq_len} cuts every record shorter than loss.unroll_steps + 1 = "
                          f"{cfg.loss.unroll_steps + 1} tokens: no position would reach the last unroll step")
