"""One run per output folder: rank 0 holds output_dir/run.lock (JSON: host, pid, the pid's start time, since).

Two runs in one folder interleave checkpoints and append to each other's metrics. The file is created with
O_CREAT|O_EXCL, atomic on local and network file systems, and removed when the run ends. A lock whose holder is
gone (a killed run: no pid, a zombie, or a pid reused by a process started later) is taken over with a notice;
a live one, or one from another host (which cannot be checked from here), refuses the run.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

LOCK_NAME = "run.lock"
HAS_PROCFS = Path("/proc/self/stat").exists()


class RunLockError(RuntimeError):
    """output_dir is in use by another run; the message names the lock file and its holder."""


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields from the state on (field 3), or None when there is no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _start_time(pid: int) -> str | None:
    """The pid's start in clock ticks since boot (stat field 22); None without procfs or such a process."""
    fields = _proc_stat(pid) if HAS_PROCFS else None
    return fields[19] if fields else None


def _holder_alive(pid: int, started: str | None) -> bool:
    """Whether the pid runs, is no zombie and started when the lock says (else it is a reused pid)."""
    if not HAS_PROCFS:  # whether the pid exists is all there is to know
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    fields = _proc_stat(pid)
    return fields is not None and fields[0] not in "ZX" and started in (None, fields[19])  # field 22: start time


def _create(path: Path) -> dict:
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": _start_time(os.getpid()),
          "since": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)  # FileExistsError: someone holds it
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(me) + "\n")
    return me


def acquire(output_dir: Path) -> dict:
    """Take output_dir's lock for this process (creating the folder), taking over a stale one; the holder record."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    while True:
        try:
            return _create(path)
        except FileExistsError:
            pass
        try:
            text = path.read_text()
        except FileNotFoundError:  # released meanwhile
            continue
        try:
            holder = json.loads(text)
            pid, host, since = int(holder["pid"]), str(holder["host"]), holder["since"]
        except (ValueError, TypeError, KeyError):
            raise RunLockError(f"{path} is unreadable as a run lock; remove it if no run uses "
                               f"output_dir={output_dir}") from None
        who = f"pid {pid} on {host} since {since}"
        if host != socket.gethostname() or _holder_alive(pid, holder.get("started")):
            raise RunLockError(f"output_dir={output_dir} is in use by {who} ({path}; remove it only if that run "
                               "is gone)")
        print(f"note: taking over {path}: its holder, {who}, is gone", file=sys.stderr)
        with suppress(FileNotFoundError):  # another run may be taking it over too: the next round decides
            if path.read_text() == text:
                path.unlink()


def release(output_dir: Path, me: dict) -> None:
    """Remove the lock if it is still this process's."""
    path = output_dir / LOCK_NAME
    try:
        if json.loads(path.read_text()) == me:
            path.unlink()
    except (OSError, ValueError):
        pass


@contextmanager
def hold(output_dir: Path) -> Iterator[None]:
    """output_dir's lock for the run on rank 0 (torchrun's RANK; a plain run is rank 0), nothing on other ranks."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    me = acquire(output_dir)
    try:
        yield
    finally:
        release(output_dir, me)
