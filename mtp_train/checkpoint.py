"""Resumable training checkpoints: DeepSpeed's folder, guarded by a JSON identity of the run, visible only complete.

`checkpoint_dir/step_N/` holds DeepSpeed's shards (the head's parameters, optimizer and lr-scheduler state, split
as the ZeRO stage splits them), `run.json` (the step and the run's identity) and `files.json` (every file's size
and sha256); `checkpoint_dir/latest` names the newest tag. The target's tensors are never in it.

A save is staged: every rank writes into `.step_N.partial/`; after a barrier (all ranks done) rank 0 writes
run.json and files.json, renames the folder to `step_N` and then moves `latest`, and a last barrier releases the
ranks. A run killed mid-save leaves a `.partial` folder, never a `step_N` or a `latest` naming one that is not whole.

`resume` picks, on rank 0, the newest checkpoint whose files match files.json (`latest` first): a damaged one is
passed over with a note naming the file, and all ranks load the one chosen. Before DeepSpeed unpickles anything it
compares run.json with this run (target and features' identity, seed, batch layout, world size, held-out records,
head and loss config): a folder received from someone else, or a run changed since, is refused with the field
named unless `trainer.resume_ignore_mismatch=true`. Head config fields added since a checkpoint was written are no
mismatch while this run holds their defaults (`comparable`). DeepSpeed's shards are torch pickles, loaded with
torch.load(weights_only=True) (mtp_train.distributed), so a planted file cannot run code.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

from data_tools.shards import atomic_write_bytes, sha256_file
from infer.models.mtp_head import config_identity
from mtp_train import distributed
from mtp_train.distributed import ZeroHead

RUN_FILE = "run.json"
FILES_FILE = "files.json"  # written last into a staged checkpoint: its files' sizes and sha256
LATEST = "latest"
_TAG = re.compile(r"step_(\d+)")


class ResumeError(ValueError):
    """A checkpoint that does not belong to this run, or none whole; the message names the field or file."""


def tag(step: int) -> str:
    return f"step_{step}"


def _staging(checkpoint_dir: Path, step: int) -> Path:
    return checkpoint_dir / f".{tag(step)}.partial"


def _json(value: dict) -> bytes:
    return (json.dumps(value, indent=1, sort_keys=True) + "\n").encode()


def _listing(folder: Path) -> dict[str, dict]:
    """Every file below `folder` but the two JSON files that describe it: relative path -> size and sha256."""
    return {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name not in (RUN_FILE, FILES_FILE)}


def _sync_folder(folder: Path) -> None:
    """Its files' bytes on disk before the rename that publishes them (a crash of the machine, not only of the run)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())


def save(zero_head: ZeroHead, checkpoint_dir: str | Path, step: int, identity: dict, rank: int) -> None:
    """Collective: every rank writes its DeepSpeed shard into the staging folder, then rank 0 publishes it whole."""
    checkpoint_dir = Path(checkpoint_dir)
    staging, final = _staging(checkpoint_dir, step), checkpoint_dir / tag(step)
    if rank == 0:  # a save of this step killed earlier left its partial folder: this one replaces it
        shutil.rmtree(staging, ignore_errors=True)
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
    distributed.barrier()
    zero_head.save(checkpoint_dir, staging.name, client_state={"step": step})
    distributed.barrier()  # every rank's files are written and closed
    if rank == 0:
        _sync_folder(staging)
        atomic_write_bytes(staging / RUN_FILE, _json({"step": step, **identity}))
        atomic_write_bytes(staging / FILES_FILE, _json(_listing(staging)))
        if final.exists():  # this step saved before a crash that came before `latest` moved: ours, replaced
            shutil.rmtree(final)
        staging.rename(final)
        atomic_write_bytes(checkpoint_dir / LATEST, tag(step).encode())
    distributed.barrier()


def _problem(folder: Path) -> str | None:
    """Why the checkpoint in `folder` cannot be resumed from (naming the file), or None when it is whole."""
    run_file, files_file = folder / RUN_FILE, folder / FILES_FILE
    if not folder.is_dir():
        return f"{folder} does not exist"
    if not run_file.is_file():
        return f"{run_file} is missing"
    if not files_file.is_file():
        return None  # written before checkpoints listed their files: taken as it is (noted by resume)
    try:
        listed = json.loads(files_file.read_text())
    except json.JSONDecodeError as err:
        return f"{files_file} is not JSON ({err})"
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != expected["size"]:
            return f"{path} has {path.stat().st_size:,} bytes, {files_file.name} lists {expected['size']:,}"
        if sha256_file(path) != expected["sha256"]:
            return f"{path} does not match its sha256 in {files_file.name}"
    return None


def _candidates(checkpoint_dir: Path) -> list[Path]:
    """The tag `latest` names first, then every step_N folder, newest first."""
    steps = sorted((int(m.group(1)), p) for p in checkpoint_dir.glob("step_*")
                   if p.is_dir() and (m := _TAG.fullmatch(p.name)))
    ordered = [p for _, p in reversed(steps)]
    latest = checkpoint_dir / LATEST
    if latest.is_file():
        named = checkpoint_dir / latest.read_text().strip()
        ordered = [named] + [p for p in ordered if p != named]
    return ordered


def choose(checkpoint_dir: str | Path) -> Path | None:
    """The newest whole checkpoint (rank 0's choice, module docstring); None when there is none to resume from.
    A damaged one is passed over with a note; when every one is damaged, a ResumeError names the newest's fault."""
    checkpoint_dir = Path(checkpoint_dir)
    for partial in sorted(checkpoint_dir.glob(".step_*.partial")):
        print(f"note: removing {partial}: a save that did not finish", file=sys.stderr)
        shutil.rmtree(partial, ignore_errors=True)
    problems = []
    for folder in _candidates(checkpoint_dir):
        problem = _problem(folder)
        if problem is None:
            if problems:
                print(f"note: resuming from {folder}, the newest whole checkpoint ({'; '.join(problems)})",
                      file=sys.stderr)
            if not (folder / FILES_FILE).is_file():
                print(f"note: {folder} lists no files (an earlier version wrote it): loaded unverified", file=sys.stderr)
            return folder
        problems.append(problem)
    if problems:
        raise ResumeError(f"no checkpoint in {checkpoint_dir} can be resumed from: {problems[0]}; point "
                          "trainer.checkpoint_dir elsewhere or set trainer.resume=false")
    return None


def mismatches(saved: dict, mine: dict, prefix: str = "") -> list[str]:
    """The fields (dotted) where two identities differ."""
    out = []
    for key in sorted(set(saved) | set(mine)):
        a, b = saved.get(key), mine.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += mismatches(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}: checkpoint {a!r}, this run {b!r}")
    return out


def comparable(identity: dict) -> dict:
    """An identity as resume compares it: the head config as what decides the head's function
    (infer.models.mtp_head.config_identity), so fields added since the checkpoint was written, holding their
    defaults, are no mismatch."""
    if not isinstance(identity.get("head"), dict):
        return identity
    return {**identity, "head": config_identity(identity["head"])}


def resume(zero_head: ZeroHead, checkpoint_dir: str | Path, identity: dict, ignore_mismatch: bool,
           rank: int = 0) -> int:
    """Collective: load the newest whole checkpoint when there is one; the step count to continue from (0 without).
    Rank 0 chooses and every rank loads its choice, so ranks never load different steps."""
    found, error = None, None
    if rank == 0:
        try:
            found = choose(checkpoint_dir)
        except ResumeError as err:
            error = str(err)
    found, error = distributed.broadcast_object((found, error))
    if error is not None:
        raise ResumeError(error)
    if found is None:
        return 0
    run_file = found / RUN_FILE
    try:
        saved = json.loads(run_file.read_text())
    except json.JSONDecodeError as err:
        raise ResumeError(f"{run_file} is not JSON: {err}") from err
    step = saved.pop("step", None)
    if not isinstance(step, int):
        raise ResumeError(f"{run_file}: no step count")
    differences = mismatches(comparable(saved), comparable(identity))
    if differences and not ignore_mismatch:
        raise ResumeError(f"{run_file}: this run differs from the checkpoint's ({'; '.join(differences[:3])}); "
                          "set trainer.resume_ignore_mismatch=true to continue anyway, or use another output_dir")
    try:
        path, client_state = zero_head.load(found.parent, found.name)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as err:
        raise ResumeError(f"{found}: DeepSpeed's checkpoint cannot be loaded safely: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    if path is None or client_state.get("step") != step:
        raise ResumeError(f"{run_file}: the DeepSpeed checkpoint beside it cannot be loaded")
    return step
