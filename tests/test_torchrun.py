"""launch/train.sh's guarantees under torchrun (2 CPU processes, gloo): a user error is one line printed once and no
traceback box; SIGTERM/SIGINT/SIGHUP reach the workers and no worker outlives a killed launcher or process group;
one run per output folder (mtp_train.run_lock: a live lock refuses, a stale one is taken over)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from mtp_train import run_lock
from tests.test_train_run import ROOT, _command, _train, features  # noqa: F401 - features: the session fixture

LONG = ["trainer.max_steps=100000", "trainer.eval_every=0", "trainer.save_every=0"]  # runs until killed


def _workers(out: Path) -> list[int]:
    """Live training workers of the run writing `out` (their command lines name it; zombies have none)."""
    marker, pids = f"output_dir={out}".encode(), []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
        except OSError:  # gone meanwhile
            continue
        if marker in argv and b"mtp_train.train" in argv and b"mtp_train.torchrun" not in argv:
            pids.append(int(proc.name))
    return pids


def _wait_gone(out: Path, seconds: float = 5.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _workers(out)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _wait_dead(pid: int, seconds: float = 5.0) -> None:
    """Until `pid` is gone or a zombie (its state in /proc/PID/stat)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in "ZX":
            return
        time.sleep(0.05)


def _lines(output: str) -> list[str]:
    """The output without set -x's echo of the command."""
    return [line for line in output.splitlines() if not line.startswith("+ ")]


@pytest.fixture
def running(tmp_path: Path, features: Path, stories_hf_dir: Path):
    """launch/train.sh with 2 workers in a process group of its own, once both run and rank 0 holds the lock."""
    out = tmp_path / "run"
    cmd, env = _command(out, features, stories_hf_dir, LONG, nproc=2)
    env["TMPDIR"] = str(tmp_path)  # the launcher's log folder, left behind where it is SIGKILLed
    with open(tmp_path / "launcher.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not ((out / run_lock.LOCK_NAME).exists() and len(_workers(out)) == 2):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launcher.log").read_text()
            time.sleep(0.1)
        yield proc, out, log
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        _wait_gone(out)


def test_user_error_under_torchrun_is_one_line_printed_once(tmp_path: Path, stories_hf_dir: Path):
    empty = tmp_path / "no-features"
    empty.mkdir()
    result = _train(tmp_path / "out", empty, stories_hf_dir, nproc=2, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    line = f"error: features_dir={empty}: no manifest.json (run python -m data_tools.precompute first)"
    assert _lines(output) == [line]
    assert "Traceback" not in output and "ChildFailedError" not in output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["train.log"]  # run.lock: released at exit


def test_unknown_config_group_under_torchrun_is_one_line_printed_once(tmp_path: Path, stories_hf_dir: Path):
    """Hydra reports such a mistake itself (on every rank, then torchrun's failure box) unless the overrides are
    composed first (mtp_train.train.precheck_overrides)."""
    result = _train(tmp_path / "out", tmp_path, stories_hf_dir, extra=["head=nosuch"], nproc=2, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    lines = _lines(output)
    assert len(lines) == 1 and lines[0].startswith("error: config: In 'config': Could not find 'head/nosuch'"), output
    assert "eagle3" in lines[0]  # the choices there are named
    assert "Traceback" not in output and "ChildFailedError" not in output


@pytest.mark.parametrize("target, sig", [("launcher", signal.SIGTERM), ("launcher", signal.SIGINT),
                                         ("launcher", signal.SIGHUP), ("group", signal.SIGTERM),
                                         ("group", signal.SIGKILL)])
def test_killed_launcher_leaves_no_worker_running_and_a_stale_lock(running, target, sig, capsys):
    proc, out, log = running
    (os.kill if target == "launcher" else os.killpg)(proc.pid, sig)
    proc.wait(30)
    assert _wait_gone(out) == []
    log.seek(0)
    output = log.read()
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), output
    assert "Traceback" not in output
    holder = json.loads((out / run_lock.LOCK_NAME).read_text())  # a killed rank 0 cannot release it: the rerun
    _wait_dead(holder["pid"])  # a dying process leaves /proc's cmdline before it is a zombie
    mine = run_lock.acquire(out)                                  # takes it over
    assert mine["pid"] == os.getpid() and capsys.readouterr().err == (
        f"note: taking over {out / run_lock.LOCK_NAME}: its holder, pid {holder['pid']} on {holder['host']} since "
        f"{holder['since']}, is gone\n")
    run_lock.release(out, mine)


def test_second_run_refused_while_the_first_holds_the_lock(running, features, stories_hf_dir):
    proc, out, _ = running
    holder = json.loads((out / run_lock.LOCK_NAME).read_text())
    assert holder["pid"] in _workers(out) and holder["host"] == socket.gethostname()
    second = _train(out, features, stories_hf_dir, nproc=2, check=False)
    output = second.stdout + second.stderr
    assert second.returncode == 2, output
    assert _lines(output) == [f"error: output_dir={out} is in use by pid {holder['pid']} on {holder['host']} "
                              f"since {holder['since']} ({out / run_lock.LOCK_NAME}; remove it only if that run "
                              "is gone)"]
    assert proc.poll() is None and json.loads((out / run_lock.LOCK_NAME).read_text()) == holder


def test_lock_of_a_live_pid_or_another_host_refuses_and_of_a_gone_or_reused_pid_is_taken_over(tmp_path, capsys):
    path = tmp_path / run_lock.LOCK_NAME
    gone = subprocess.Popen(["true"])
    gone.wait()
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid, "started": None, "since": "then"}))
    me = run_lock.acquire(tmp_path)
    assert f"its holder, pid {gone.pid} on {socket.gethostname()} since then, is gone" in capsys.readouterr().err
    with pytest.raises(run_lock.RunLockError, match=f"in use by pid {os.getpid()} on {me['host']} since"):
        run_lock.acquire(tmp_path)
    path.write_text(json.dumps({**me, "host": "elsewhere"}))
    with pytest.raises(run_lock.RunLockError, match="in use by pid .* on elsewhere"):
        run_lock.acquire(tmp_path)
    path.write_text(json.dumps({**me, "started": "0"}))  # this pid, but started at another time: reused
    mine = run_lock.acquire(tmp_path)
    assert mine["pid"] == os.getpid() and "taking over" in capsys.readouterr().err
    run_lock.release(tmp_path, mine)
    assert not path.exists()
