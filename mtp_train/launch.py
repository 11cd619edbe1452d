"""launch/train.sh's launcher: torchrun's elastic agent (torch.distributed.run), plus what the agent leaves out.

    python -m mtp_train.launch [torchrun options] -m mtp_train.train [overrides]

- A user error (mtp_train.trainer.USER_ERRORS, the output lock) comes back from the workers through torchrun's
  error files and is printed once per distinct message, as one line, exit code 2: not once per rank followed by
  the agent's ChildFailedError traceback box. Any other failure gets torchrun's full report, as before.
- The agent forwards SIGTERM, SIGINT and SIGHUP to the workers (torchrun's --signals_to_handle), each of which
  ends a worker at once, and the launcher then exits 128 + the signal, without a traceback.
- Workers die with the agent even when it is SIGKILLed: torchrun starts them in sessions of their own, out of
  reach of a process-group kill, so each one asks the kernel for SIGKILL on its parent's death (bind_to_launcher).

The worker half (bind_to_launcher, exit_on_user_error) needs no torch: mtp_train.train's `--cfg job` stays quick.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import NoReturn

LAUNCHER_PID_ENV = "MTP_TRAIN_LAUNCHER_PID"  # set by the launcher for its workers: the agent's pid
USER_ERROR_EXIT = 2
USER_ERROR_KEY = "mtp_train_user_error"  # in a worker's error file: the message is a user error's one line
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


# --- in the workers -------------------------------------------------------------------------------------------
def bind_to_launcher() -> None:
    """Under this launcher, die with the agent: the kernel SIGKILLs this worker when the agent dies, by whatever
    signal, and the SIGINT the agent forwards kills it at once, as its SIGTERM and SIGHUP do.

    Python would turn that SIGINT into a KeyboardInterrupt: a traceback per rank for a user's Ctrl-C, and an unwind
    into dist.shutdown()'s barrier with peers that are being stopped too. A no-op elsewhere (plain runs, plain
    torchrun, not Linux). The parent check closes the race of an agent that died before the prctl: the worker was
    already handed to another parent and would never get the signal.
    """
    launcher = os.environ.get(LAUNCHER_PID_ENV)
    if launcher is None or not sys.platform.startswith("linux"):
        return
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != int(launcher):
        raise SystemExit(f"mtp_train.train: its launcher (pid {launcher}) is gone; not starting")


def exit_on_user_error(err: Exception) -> NoReturn:
    """Report a user's mistake as one line and exit 2: to the launcher through torchrun's error file (it prints
    each distinct line once for all ranks), else on stderr."""
    line = f"error: {' '.join(str(err).split())}"
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE") if LAUNCHER_PID_ENV in os.environ else None
    if error_file:
        Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time()), USER_ERROR_KEY: True}))
    else:
        print(line, file=sys.stderr)
    raise SystemExit(USER_ERROR_EXIT) from err


# --- in the launcher ------------------------------------------------------------------------------------------
def _is_user_error(error_file_data: object) -> bool:
    return isinstance(error_file_data, dict) and error_file_data.get(USER_ERROR_KEY) is True


class _QuietAfterUserError(logging.Filter):
    """Drops the agent's 'failed (exitcode ...)' and 'Sending process ... closing signal' lines once a worker has
    reported a user error: stopping the other workers is routine then, and the error line says what happened."""

    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_dir = log_dir

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(("failed (exitcode", "Sending process")):
            return True
        for path in self.log_dir.rglob("error.json"):  # <log_dir>/<run id>/attempt_<n>/<local rank>/error.json
            try:
                if _is_user_error(json.loads(path.read_text())):
                    return False
            except (OSError, ValueError):
                continue
        return True


def _agent(args: argparse.Namespace) -> int:
    """Run torchrun's agent; a failure with a user error is one line per distinct message (the other ranks'
    failures follow from it), anything else propagates to torchrun's report."""
    from torch.distributed import run as torchrun  # noqa: PLC0415 - keep the worker half free of torch
    from torch.distributed.elastic.multiprocessing.api import SignalException  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: PLC0415

    try:
        torchrun.run(args)
    except ChildFailedError as err:
        failures = [err.failures[rank] for rank in sorted(err.failures)]
        user = [f for f in failures if _is_user_error(f.error_file_data)]
        if not user:
            raise  # a crash: torchrun's report, the first failure as its root cause
        # The other ranks' failures follow from it (stopped by the agent, or their collective with the rank that
        # left failed): the user's mistake is the one line to read.
        print("\n".join(dict.fromkeys(f.message for f in user)), file=sys.stderr)
        return USER_ERROR_EXIT
    except SignalException as err:  # the agent has stopped the workers; its warning named the signal
        return 128 + int(err.sigval)
    return 0


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun  # noqa: PLC0415
    from torch.distributed.elastic.multiprocessing.errors import record  # noqa: PLC0415

    args = torchrun.parse_args(argv)
    own_log_dir = args.log_dir is None  # torchrun would make (and leave) a temporary one; ours goes at exit
    if own_log_dir:
        args.log_dir = tempfile.mkdtemp(prefix="mtp-train-launch-")
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(
        _QuietAfterUserError(Path(args.log_dir)))
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    try:
        return record(_agent)(args)  # record: torchrun's own error-file handling for the launcher itself
    finally:
        if own_log_dir:
            shutil.rmtree(args.log_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
