"""Rank 0's reporting: a tqdm bar (loss, lr, tokens/s) or, without it, a line every log_every steps;
metrics.jsonl (every record); wandb (disabled/offline/online)."""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from mtp_train.config import TrainConfig

WANDB_MODES = ("disabled", "offline", "online")


class Metrics:
    def __init__(self, cfg: TrainConfig, rank: int, start_step: int, total_steps: int, out_dir: Path) -> None:
        self.enabled = rank == 0
        if cfg.wandb.mode not in WANDB_MODES:
            raise ValueError(f"wandb.mode={cfg.wandb.mode!r}: choose one of {WANDB_MODES}")
        self.bar = self.run = None
        self.log_every = max(1, int(cfg.trainer.log_every))
        if not self.enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self.file = open(out_dir / "metrics.jsonl", "a")  # appended across resumes
        if cfg.trainer.progress:
            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        if cfg.wandb.mode != "disabled":
            import wandb  # noqa: PLC0415

            self.run = wandb.init(project=cfg.wandb.project, name=cfg.wandb.name, mode=cfg.wandb.mode,
                                  dir=str(out_dir), config=asdict(cfg), resume="allow")

    def log(self, record: dict) -> None:
        if not self.enabled or not record:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.run is not None:
            self.run.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=record["step"])
        if self.bar is not None and record.get("split") == "train":
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                 tok_s=f"{record['tokens_per_s']:.0f}")
        elif record.get("split") in ("eval", "validate") or record["step"] % self.log_every == 0:  # plain lines
            line = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                            for k, v in record.items() if k != "records")
            (self.bar.write if self.bar is not None else print)(line)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()
        self.file.close()


class PhaseTimer:
    """Seconds per phase of a step (trainer.time_phases): each `lap` adds the time since the last one to its name,
    the device synchronised first so a GPU's queued kernels count where they were launched. Off: no syncs, no keys."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device, self.enabled = device, enabled
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self._last
        self._last = now
