"""Head validation through infer's Engine (mtp_train.validate) on stories260K.

- The report of an untrained head (the target's last layer) has the structure the trainer and the CLI read, with
  the identities that hold by construction: conditional acceptance (accepted / reached) in [0, 1] with its standard
  error, the unconditional share non-increasing over draft positions (a draft is accepted only after the one before
  it), the histogram summing to the verify steps, tau = 1 + its mean, the trainer's figures on the greedy text within
  2 points of the runtime's. The trainer's in-memory head is left as it was (mode, grads, dtype).
- Conditional acceptance and its error from a histogram; the gap flag: more than 2 points at any position.
- The CLI writes report.json and PNGs, reads MT-bench-style prompt files and the run's metrics.jsonl, accepts Hydra
  overrides, and turns user mistakes into one-line errors with exit 2.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from infer.cli import run_cli
from infer.engine import Engine
from infer.models.mtp_head import HeadLoadError, init_head_from_target, save_head
from infer.prompts import VALIDATION_PROMPTS
from mtp_train.validate import conditional_acceptance, main, replay_gap, validate_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ["--num-draft-tokens", "2", "--max-new-tokens", "12", "--batch-size", "4", "--repeats", "1"]


@pytest.fixture(scope="module")
def trainer_head(stories_model):
    """An untrained head as the trainer holds it: training mode, parameters requiring grad."""
    return init_head_from_target(stories_model, "stories260K").train().requires_grad_(True)


@pytest.fixture(scope="module")
def head_dir(trainer_head, tmp_path_factory) -> Path:
    return save_head(trainer_head, tmp_path_factory.mktemp("head") / "head")


@pytest.fixture(scope="module")
def report(stories_hf_dir, trainer_head) -> dict:
    return validate_head(stories_hf_dir, trainer_head, VALIDATION_PROMPTS[:4], k=3, max_new_tokens=24, batch_size=4,
                         repeats=1)


def test_report_structure_and_identities(report):
    assert [run["temperature"] for run in report["runs"]] == [0.0, 1.0]
    for run in report["runs"]:
        shares, histogram = run["unconditional_acceptance"], run["accepted_length_histogram"]
        assert len(shares) == 3 and len(histogram) == 4
        assert all(0.0 <= a <= 1.0 for a in shares + run["conditional_acceptance"])
        assert shares == sorted(shares, reverse=True)
        assert run["reached"][0] == sum(histogram) == run["verify_steps"] > 0
        assert run["conditional_acceptance"][0] == pytest.approx(shares[0], abs=1e-4)
        assert run["tau"] >= 1.0
        assert run["tau"] == pytest.approx(1 + sum(n * c for n, c in enumerate(histogram)) / sum(histogram), abs=1e-4)
        assert run["speedup"] > 0 and run["ideal_speedup"] > 0
    replay = report["trainer_replay"]
    assert len(replay["top1"]) == len(replay["cond_top1"]) == len(replay["at_verify_steps"]) == 3 > 0 < replay["positions"]
    assert math.isfinite(replay["kl"][0]) and replay["kl"][0] >= 0
    assert len(report["replay_gap"]) == 3 and report["gap_flag"] is False  # the trainer computes what is served
    assert report["distinct_prompts"] == report["num_prompts"] == 4
    json.dumps(report)


def test_the_trainers_head_is_left_as_it_was(report, trainer_head):
    assert trainer_head.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trainer_head.parameters())


def test_validation_prompts_are_64_distinct_openings():
    assert len(VALIDATION_PROMPTS) == len(set(VALIDATION_PROMPTS)) == 64


def test_conditional_acceptance_and_gap_flag():
    # 10 steps: 4 accepted nothing, 3 one draft, 2 two, 1 all three
    rates, errors, reached = conditional_acceptance([4, 3, 2, 1])
    assert reached == [10, 6, 3]
    assert rates == [0.6, 0.5, pytest.approx(1 / 3, abs=1e-4)]
    assert errors[0] == pytest.approx(math.sqrt(0.6 * 0.4 / 10), abs=1e-4)
    assert conditional_acceptance([5, 0, 0]) == ([0.0, 0.0], [0.0, 0.0], [5, 0])
    greedy = {"conditional_acceptance": [0.50, 0.40]}
    assert replay_gap({"at_verify_steps": [0.52, 0.40]}, greedy) == ([0.02, 0.0], False)  # exactly 2 points is not over
    assert replay_gap({"at_verify_steps": [0.50, 0.379]}, greedy)[1] is True  # the runtime beating the trainer counts too
    assert replay_gap({"at_verify_steps": [0.5]}, None) == ([], False)


def test_engine_target_and_head_folder(stories_hf_dir, head_dir):
    engine = Engine.from_pretrained(stories_hf_dir, num_pages=8)
    report = validate_head(engine, head_dir, VALIDATION_PROMPTS[:2], k=2, temperatures=(0.0,), max_new_tokens=8,
                           batch_size=2, repeats=1)
    assert report["head"] == str(head_dir) and report["runs"][0]["verify_steps"] > 0


def test_a_head_for_another_target_is_refused(stories_model, stories_hf_dir, tmp_path):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    with pytest.raises(HeadLoadError, match="trained against"):
        validate_head(stories_hf_dir, init_head_from_target(other, "other"), VALIDATION_PROMPTS[:1], max_new_tokens=2)


def test_cli_writes_report_and_plots(stories_hf_dir, head_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    metrics = [{"split": "train", "step": s, "loss": 2.0 / s, "lr": 1e-3, "top1_0": 0.1 * s, "tokens_per_s": 1.0}
               for s in range(1, 5)]
    metrics.append({"split": "eval", "step": 4, "loss": 0.6, "kl_0": 0.6, "top1_0": 0.42})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in metrics) + '\n{"step": 5, "lo')
    prompts = tmp_path / "questions.jsonl"  # MT-bench's shape: the first turn is the prompt
    prompts.write_text('{"question_id": 1, "turns": ["Once upon a time", "Then?"]}\n{"prompt": "Tom had a dog."}\n')
    out = tmp_path / "out"
    argv = ["--target", str(stories_hf_dir), "--head", str(head_dir), "--prompts", str(prompts), "--out", str(out),
            "--run-dir", str(run_dir), *FAST]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "acc@1" in printed and "speedup" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["num_prompts"] == 2 and report["trainer_replay"]["positions"] > 0
    assert report["metrics"] == {"file": str(run_dir / "metrics.jsonl"), "records": 5, "skipped_lines": 1}
    assert sorted(report["plots"]) == ["acceptance_per_position.png", "accepted_length_histogram.png",
                                       "training_curves.png"]
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_cli_hydra_overrides_name_target_and_head(stories_hf_dir, head_dir, tmp_path):
    out = tmp_path / "out"
    assert main([f"model.path={stories_hf_dir}", f"head_dir={head_dir}", f"output_dir={tmp_path / 'run'}",
                 "--out", str(out), "--temperatures", "0", *FAST]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == str(stories_hf_dir) and report["head"] == str(head_dir)


@pytest.mark.parametrize("case,message", [
    ("missing_head", "head folder .* does not exist"),
    ("other_target", "trained against 'other'"),
    ("bad_override", "overrides"),
])
def test_cli_user_mistakes_are_one_line_errors(stories_model, stories_hf_dir, tmp_path, capsys, case, message):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    foreign = save_head(init_head_from_target(other, "other"), tmp_path / "foreign")
    argv = {
        "missing_head": ["--target", str(stories_hf_dir), "--head", str(tmp_path / "nope")],
        "other_target": ["--target", str(stories_hf_dir), "--head", str(foreign)],
        "bad_override": ["--target", str(stories_hf_dir), "--head", str(foreign), "no_such_group=x"],
    }[case]
    assert run_cli(lambda: main([*argv, "--out", str(tmp_path / "out"), *FAST])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    import re

    assert re.search(message, err), err
