"""`python -m tests.fail_rank PHASE RANK [overrides]`: mtp_train.train with an exception raised on rank RANK alone at
PHASE, after writing the time it fails to output_dir/failed_at (the test measures how long the job takes to end).

Phases: resume (loading the checkpoint: the shard unreadable), step (the first training step: out of memory),
save (the first checkpoint: the disk full), validation (the first validation)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from mtp_train import distributed, train
from mtp_train.trainer import Trainer

FAILURES = {
    "resume": (distributed.ZeroHead, "load",
               OSError("PytorchStreamReader failed reading zip archive: failed finding central directory")),
    "step": (Trainer, "train_step", RuntimeError("injected: CPU out of memory")),
    "save": (distributed.ZeroHead, "save", OSError(28, "injected: No space left on device")),
    "validation": (Trainer, "validate", RuntimeError("injected: validation failed")),
}


def main() -> None:
    phase, rank = sys.argv.pop(1), int(sys.argv.pop(1))
    owner, name, error = FAILURES[phase]
    out = next(Path(a.split("=", 1)[1]) for a in sys.argv if a.startswith("output_dir="))
    original = getattr(owner, name)

    def failing(*args, **kwargs):
        if int(os.environ.get("RANK", 0)) == rank:
            (out / "failed_at").write_text(repr(time.time()))
            raise error
        return original(*args, **kwargs)

    setattr(owner, name, failing)
    train.main()


if __name__ == "__main__":
    main()
