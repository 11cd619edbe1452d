"""`python -m tests.kill_after_step N [overrides]`: mtp_train.train, SIGKILLed right after optimizer step N
(with its evaluation and checkpoint done), as a crash would stop it.

`python -m tests.kill_after_step save:N [overrides]`: SIGKILLed in the middle of step N's checkpoint, once every
rank has written its DeepSpeed files and before rank 0 publishes the folder."""

from __future__ import annotations

import os
import signal
import sys

from mtp_train import checkpoint, train
from mtp_train.trainer import Trainer


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    where, _, step = sys.argv.pop(1).rpartition(":")
    kill_at = int(step)
    if where == "save":
        sync_folder = checkpoint._sync_folder

        def sync_or_die(folder):
            if folder.name == f".{checkpoint.tag(kill_at)}.partial":
                die()
            sync_folder(folder)

        checkpoint._sync_folder = sync_or_die
    else:
        train_step = Trainer.train_step

        def train_step_or_die(self: Trainer) -> dict:
            if self.step == kill_at:  # step N and everything after it in the loop have run
                die()
            return train_step(self)

        Trainer.train_step = train_step_or_die
    train.main()


if __name__ == "__main__":
    main()
