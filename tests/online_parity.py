"""`torchrun --nproc_per_node 2 -m tests.online_parity OUT MODEL`: online against precomputed features, in one job.

Both ranks, in one process group (gloo): precompute the records at tp=1 and tp=2 (data_tools.precompute.run, one
record per forward), then for t in (1, 2) train features=offline on those shards and features=online with online.tp=t
for STEPS steps each (Trainer.train_step), keeping every loss and the features of the first micro batches; then a
checkpoint resumed with another target (refused, naming the key); and a control run online whose features are
rounded to bf16 (the comparison must see that). Rank 0 writes
OUT/results.json; tests/test_online.py asserts on it.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from data_tools import precompute
from data_tools.config import compose
from infer import parallel
from mtp_train import distributed
from mtp_train.checkpoint import ResumeError
from mtp_train.config import compose_training
from mtp_train.trainer import Trainer

STEPS, FEATURE_BATCHES, CUT = 20, 3, 40
DATA = ["data=sharegpt_dummy", "data.limit=24", "data.max_length=48", "head=eagle3"]
TRAIN = ["trainer=zero2", "trainer.dtype=float32", f"trainer.max_steps={STEPS}", "trainer.micro_batch_size=2",
         "trainer.seq_len=48", "trainer.grad_accum=1", "trainer.eval_every=0", "trainer.save_every=0",
         "trainer.progress=false", "eval_records=4", "loss.unroll_steps=2", "validate.enabled=false",
         "head.intermediate_size=null", "head.draft_vocab_tokens=2000"]
TIMED: list[str] = []  # phase keys logged by runs without trainer.time_phases (there must be none)
ONLINE = ["features=online", "online.dtype=float32", "online.max_records_per_batch=1"]


def trainer(out: Path, model: str, extra: list[str]) -> Trainer:
    cfg = compose_training([*DATA, *TRAIN, f"model.path={model}", f"output_dir={out}", *extra])
    return Trainer(OmegaConf.to_object(cfg))


def record_features(batch, cut: int) -> list[torch.Tensor]:
    """Each record's [first `cut` tokens, 1 + aux layers, hidden] states of a micro batch (no padding)."""
    states = torch.cat((batch.hidden_states[:, None], batch.aux_hidden_states), 1)
    starts = torch.tensor([0, *batch.seq_lens]).cumsum(0).tolist()
    return [states[starts[r] : starts[r] + min(batch.seq_lens[r], cut)] for r in range(len(batch.record_ids))]


def train(run: Trainer, steps: int, cut: int = 10**9) -> tuple[list[float], list[torch.Tensor], list[list[int]]]:
    """The run's losses over `steps` steps, this rank's records' features in its first micro batches, its records."""
    features = [f for n in range(FEATURE_BATCHES) for f in record_features(run.micro_batches(n), cut)]
    steps_run = [run.train_step() for _ in range(steps)]
    TIMED.extend(k for r in steps_run for k in r if k in ("data_s", "head_s", "optimizer_s"))
    return [r["loss"] for r in steps_run], features, [r["records"] for r in steps_run]


def main() -> None:
    out, model = Path(sys.argv[1]), sys.argv[2]
    results: dict = {}
    for t in (1, 2):
        features_dir = out / f"features_tp{t}"
        with parallel.sharding_over(parallel.current()):  # precompute joins its tp group; training's stays whole
            precompute.run(compose("precompute", [*DATA, f"model.path={model}", f"output_dir={features_dir}",
                                                  "precompute.dtype=float32", "precompute.max_records_per_batch=1",
                                                  f"precompute.tp={t}", "precompute.progress=false"]))
        offline = trainer(out / f"offline{t}", model, [f"features_dir={features_dir}"])
        offline_loss, offline_features, offline_records = train(offline, STEPS)
        online = trainer(out / f"online{t}", model, [*ONLINE, f"online.tp={t}"])
        online_loss, online_features, online_records = train(online, STEPS)
        # online's default packing, records cut to 40 tokens (prefilled only that far): other shapes than offline's
        packed = trainer(out / f"packed{t}", model, [*ONLINE[:-1], f"online.tp={t}", "trainer.time_phases=true",
                                                     f"trainer.seq_len={CUT}"])
        packed_features = train(packed, 0)[1]
        packed_steps = [packed.train_step() for _ in range(2)]
        results[f"t{t}"] = {
            "offline": offline_loss, "online": online_loss,
            "bitwise": len(offline_features) == len(online_features) > 0
            and all(torch.equal(a, b) for a, b in zip(offline_features, online_features)),
            "packed_max_diff_over_range": max(float((a[:CUT] - b).abs().max() / (a.max() - a.min()))
                                              for a, b in zip(offline_features, packed_features)),
            "packed_rows": [len(b) for b in packed_features],
            "same_records": offline_records == online_records,
            "phases": [{k: r[k] for k in ("data_s", "head_s", "optimizer_s", "tokens", "tokens_per_s")}
                       for r in packed_steps],
        }
    results["without_phases"] = sorted(set(TIMED))
    # a checkpoint of this target (a step, saved), then the same run on another target: refused on resume
    first = trainer(out / "resumed", model, [*ONLINE, "online.tp=2"])
    first.train_step()
    first.save_checkpoint()
    other = out / "other_target"  # the same shapes, another target: its features are another run's
    if first.rank == 0:
        shutil.copytree(model, other)
        tensors = load_file(other / "model.safetensors")
        tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.5
        save_file(tensors, other / "model.safetensors")
    distributed.barrier()
    try:
        trainer(out / "resumed", str(other), [*ONLINE, "online.tp=2"])
        results["other_target"] = None
    except ResumeError as err:
        results["other_target"] = str(err)
    control = trainer(out / "control", model, ["features=online", "online.dtype=bfloat16"])
    results["control_bf16"] = [control.train_step()["loss"] for _ in range(3)]
    if first.rank == 0:
        (out / "results.json").write_text(json.dumps(results))
    distributed.shutdown()


if __name__ == "__main__":
    main()
