"""`python -m tests.kill_after_step N [overrides]`: mtp_train.train, SIGKILLed right after optimizer step N
(with its evaluation and checkpoint done), as a crash would stop it."""

from __future__ import annotations

import os
import signal
import sys

from mtp_train import train
from mtp_train.trainer import Trainer


def main() -> None:
    kill_after = int(sys.argv.pop(1))
    train_step = Trainer.train_step

    def train_step_or_die(self: Trainer) -> dict:
        if self.step == kill_after:  # step N and everything after it in the loop have run
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self)

    Trainer.train_step = train_step_or_die
    train.main()


if __name__ == "__main__":
    main()
