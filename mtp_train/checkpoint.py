"""Resumable training checkpoints: DeepSpeed's folder, guarded by a JSON identity of the run written beside it.

`checkpoint_dir/step_N/` holds DeepSpeed's shards (the head's parameters, optimizer and lr-scheduler state, split
as the ZeRO stage splits them) and `run.json`; `checkpoint_dir/latest` names the newest tag. The target's tensors
are never in it (they are not parameters of the trained module).

`run.json` holds the step and everything that decides the data order and the objective: the target and the
features' identity, seed, batch layout (micro batch, sequence length, accumulation, world size), held-out records,
head and loss config. It is written (atomically) before DeepSpeed writes the tag, and `resume` reads and compares it
before DeepSpeed unpickles anything: a folder received from someone else, or a run changed since, is refused with
the field named, unless the override `trainer.resume_ignore_mismatch=true` says to continue anyway. Head config
fields added since a checkpoint was written are no mismatch while this run holds their defaults (`comparable`). DeepSpeed's
shards are torch pickles; they are loaded only after that check, and then with torch.load(weights_only=True)
(mtp_train.distributed), so a planted file cannot run code.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

from infer.models.mtp_head import config_identity
from mtp_train.distributed import ZeroHead

RUN_FILE = "run.json"


class ResumeError(ValueError):
    """A checkpoint that does not belong to this run; the message names the field."""


def tag(step: int) -> str:
    return f"step_{step}"


def save(zero_head: ZeroHead, checkpoint_dir: str | Path, step: int, identity: dict, rank: int) -> None:
    """Collective: rank 0 writes run.json, then every rank writes its DeepSpeed shard."""
    folder = Path(checkpoint_dir) / tag(step)
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{RUN_FILE}.tmp"
        tmp.write_text(json.dumps({"step": step, **identity}, indent=2, sort_keys=True) + "\n")
        tmp.replace(folder / RUN_FILE)
    zero_head.save(checkpoint_dir, tag(step), client_state={"step": step})


def latest_identity(checkpoint_dir: str | Path) -> tuple[Path, dict] | None:
    """(run.json path, its contents) of the checkpoint `latest` names; None when there is no checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    latest = checkpoint_dir / "latest"
    if not latest.is_file():
        return None
    run_file = checkpoint_dir / latest.read_text().strip() / RUN_FILE
    if not run_file.is_file():
        raise ResumeError(f"{run_file} is missing: {checkpoint_dir} was not written by this trainer (its checkpoints "
                          "are not loaded without one); point trainer.checkpoint_dir elsewhere or set "
                          "trainer.resume=false")
    try:
        return run_file, json.loads(run_file.read_text())
    except json.JSONDecodeError as err:
        raise ResumeError(f"{run_file} is not JSON: {err}") from err


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


def resume(zero_head: ZeroHead, checkpoint_dir: str | Path, identity: dict, ignore_mismatch: bool) -> int:
    """Load checkpoint_dir/latest when there is one; returns the step count to continue from (0 without)."""
    found = latest_identity(checkpoint_dir)
    if found is None:
        return 0
    run_file, saved = found
    step = saved.pop("step", None)
    if not isinstance(step, int):
        raise ResumeError(f"{run_file}: no step count")
    differences = mismatches(comparable(saved), comparable(identity))
    if differences and not ignore_mismatch:
        raise ResumeError(f"{run_file}: this run differs from the checkpoint's ({'; '.join(differences[:3])}); "
                          "set trainer.resume_ignore_mismatch=true to continue anyway, or use another output_dir")
    try:
        path, client_state = zero_head.load(checkpoint_dir)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as err:
        raise ResumeError(f"{run_file.parent}: DeepSpeed's checkpoint cannot be loaded safely: "
                          f"{str(err).splitlines()[0] if str(err) else type(err).__name__}") from err
    if path is None or client_state.get("step") != step:
        raise ResumeError(f"{run_file}: the DeepSpeed checkpoint beside it cannot be loaded")
    return step
