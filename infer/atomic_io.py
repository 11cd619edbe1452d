"""Folders written whole or not at all: a temp folder beside the target, renamed into place.

Heads and exports are folders of several files; a reader (or a crash) must never see half of one. The old folder,
when there is one, is swapped out first and removed only after the new one is in place, and only when it holds
nothing but what the same command writes: no command deletes what it did not write.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class OutputExistsError(ValueError):
    """An output folder that holds something this command would replace without having written it."""


def check_replaceable(out: Path, owned: tuple[str, ...], overwrite: bool) -> None:
    """Refuse to replace a non-empty `out` unless overwrite is asked and it holds only the `owned` files."""
    if not out.exists():
        return
    if not out.is_dir():
        raise OutputExistsError(f"{out} exists and is not a folder")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    foreign = [name for name in entries if name not in owned]
    if foreign:
        raise OutputExistsError(f"{out} holds {', '.join(foreign[:3])}, which this command did not write: "
                                "choose an empty or new folder")
    if not overwrite:
        raise OutputExistsError(f"{out} already holds {', '.join(entries)}: pass --overwrite to replace them")


@contextmanager
def atomic_folder(out: str | Path, owned: tuple[str, ...] = (), overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp folder beside `out`; on success it replaces `out` (a crash leaves the old folder or the new).

    A non-empty `out` is replaced only when overwrite is true and it holds nothing but the `owned` file names
    (what an earlier run of the same command wrote).
    """
    out = Path(out)
    check_replaceable(out, owned, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
