"""DeepSpeed checkpoints (resume) and the exported head folder (serving).

A checkpoint is DeepSpeed's own folder (`checkpoint_dir/step_N/`, `checkpoint_dir/latest`): the head's
parameters, optimizer and lr-scheduler state, sharded as the ZeRO stage shards them. The target's tensors are
never in it (they are not parameters of the engine's module). Its client state records the step count (the
data position is a function of it, see mtp_train.data) and the target's identity; resuming against another
target, or with another head architecture, fails with the mismatch named.

The export is infer's head folder (`save_head`), loadable by `infer.models.mtp_head.load_head` and
`Engine.load_drafter("mtp", DIR)`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from infer.models.mtp_head import MTPHead, save_head


class ResumeError(ValueError):
    """A checkpoint that does not belong to this run's target or head."""


def save(engine, checkpoint_dir: str | Path, step: int, head: MTPHead) -> None:
    """Collective: every rank writes its shard."""
    client_state = {"step": step, "target": head.config.target, "head_config": asdict(head.config)}
    engine.save_checkpoint(str(checkpoint_dir), tag=f"step_{step}", client_state=client_state)


def resume(engine, checkpoint_dir: str | Path, head: MTPHead) -> int:
    """Load checkpoint_dir/latest when there is one; returns the step count to continue from (0 without)."""
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "latest").is_file():
        return 0
    path, client_state = engine.load_checkpoint(str(checkpoint_dir))
    if path is None:
        raise ResumeError(f"{checkpoint_dir}: `latest` names a checkpoint that cannot be loaded")
    saved, mine = client_state.get("target", {}), head.config.target
    for key in ("hidden_size", "vocab_size", "shared_tensors_sha256"):
        if saved.get(key) != mine.get(key):
            raise ResumeError(f"{path}: checkpoint was trained against target {saved.get('name')!r} "
                              f"({key}={saved.get(key)}), this run's target {mine.get('name')!r} has {mine.get(key)}")
    saved_arch = client_state.get("head_config", {}).get("architecture")
    if saved_arch != head.config.architecture:
        raise ResumeError(f"{path}: checkpoint is a {saved_arch!r} head, this run trains {head.config.architecture!r}")
    return int(client_state["step"])


def export_head(head: MTPHead, out: str | Path, rank: int, zero_stage: int) -> Path:
    """Collective under ZeRO-3 (parameters are gathered on every rank); rank 0 writes the folder."""
    out = Path(out)
    if zero_stage == 3:
        import deepspeed  # noqa: PLC0415

        with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
            if rank == 0:
                save_head(head, out)
    elif rank == 0:
        save_head(head, out)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    return out
