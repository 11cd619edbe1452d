"""Train an MTP / EAGLE-1 head with DeepSpeed.

    python -m mtp_train.train features_dir=DIR [model=stories260k] [head=mtp] [trainer=zero2] [key=value ...]
    python -m mtp_train.train features=online [online.tp=T] ...  # the target computes the features in the job
    torchrun --standalone --nproc_per_node 8 -m mtp_train.train model=llama3_1_8b model.path=DIR features_dir=DIR
    python -m mtp_train.train model=llama3_1_70b --cfg job        # print the composed config and exit
    launch/train.sh ...                                           # torchrun for one node or many (see launch/)

Outputs in output_dir: checkpoints/ (DeepSpeed, resumable), head/ (infer's head folder), metrics.jsonl,
summary.json; run.lock while the run lasts (mtp_train.run_lock: one run per folder).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mtp_train import torchrun

if __name__ == "__main__":  # first: a launcher's SIGINT must stop this worker cleanly even during the imports below
    torchrun.bind_to_launcher()

import hydra  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from data_tools.config import CONF_DIR  # noqa: E402
from mtp_train import run_lock  # noqa: E402
from mtp_train.config import TrainConfig  # noqa: E402, F401 - registers the schema conf/config.yaml names


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(cfg: DictConfig) -> None:
    from data_tools.config import ConfigError, check  # noqa: PLC0415 - keep `--cfg job` free of torch start-up
    from mtp_train.config import check_training  # noqa: PLC0415

    try:
        check(cfg)
        check_training(cfg)
        with run_lock.hold(Path(cfg.output_dir)):  # before torch's start-up: a refused run ends at once
            train(cfg)
    except (ConfigError, run_lock.RunLockError) as err:
        torchrun.exit_on_user_error(err)


def train(cfg: DictConfig) -> None:
    from mtp_train import distributed  # noqa: PLC0415
    from mtp_train.trainer import USER_ERRORS, Trainer  # noqa: PLC0415

    try:
        Trainer(OmegaConf.to_object(cfg)).fit()  # the typed TrainConfig
    except BaseException as err:
        # No barrier on the way out: the peers may be waiting in a collective this rank will never join. Its exit
        # ends theirs (torchrun's agent stops the other workers; a peer's gloo collective fails at once).
        if isinstance(err, USER_ERRORS):  # a config or data mistake: one line, no traceback
            torchrun.exit_on_user_error(err)
        if distributed.peer_failed(err):  # the other rank's error is the one to read: no second traceback
            print(f"note: rank {os.environ.get('RANK', 0)} stopped: {str(err).splitlines()[0]}", file=sys.stderr)
            raise SystemExit(1) from err
        raise
    distributed.shutdown()


def precheck_overrides(argv: list[str]) -> None:
    """Compose the key=value overrides once before Hydra does: Hydra reports an unknown config group or key itself
    (on every rank, then torchrun's failure box), where this makes it one user error like any other."""
    from data_tools.config import ConfigError  # noqa: PLC0415
    from mtp_train.config import compose_training  # noqa: PLC0415

    try:
        compose_training([a for a in argv if "=" in a and not a.startswith("-")], complete=False)
    except ConfigError as err:
        torchrun.exit_on_user_error(err)


if __name__ == "__main__":
    precheck_overrides(sys.argv[1:])
    sys.exit(main())
