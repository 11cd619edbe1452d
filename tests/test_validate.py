"""Head validation through infer's Engine (mtp_train.validate) on stories260K.

- The report of an untrained head (the target's last layer) has the structure the trainer and the CLI read, with
  the identities that hold by construction: acceptance in [0, 1] and non-increasing over draft positions (a draft
  is accepted only after the one before it), the histogram summing to the verify steps, tau = 1 + its mean, finite
  KL >= 0. The trainer's in-memory head is left as it was (mode, grads, dtype).
- The recomputed loss compares the right rows: the head's logits at the last position of a sequence equal the
  drafter's carry in the engine after the same prefill (the token the head reads and the hidden state it pairs
  with are those the runtime uses).
- The gap flag: more than 2 points between the trainer's top-1 and greedy acceptance at position 0, and a warning.
- The CLI writes report.json and PNGs, reads MT-bench-style prompt files and the run's metrics.jsonl, accepts Hydra
  overrides, and turns user mistakes into one-line errors with exit 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from infer.cli import run_cli
from infer.engine import Engine, EngineConfig
from infer.models.mtp_head import HeadLoadError, init_head_from_target, save_head
from infer.sampling_params import SamplingParams
from mtp_train.validate import DEFAULT_PROMPTS, aligned_logits, main, serving_head, top1_gap, validate_head

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
    return validate_head(stories_hf_dir, trainer_head, DEFAULT_PROMPTS[:4], k=3, max_new_tokens=24, batch_size=4,
                         repeats=1)


def test_report_structure_and_identities(report):
    assert [run["temperature"] for run in report["runs"]] == [0.0, 1.0]
    for run in report["runs"]:
        acceptance, histogram = run["acceptance_per_position"], run["accepted_length_histogram"]
        assert len(acceptance) == 3 and len(histogram) == 4
        assert all(0.0 <= a <= 1.0 for a in acceptance)
        assert acceptance == sorted(acceptance, reverse=True)
        assert sum(histogram) == run["verify_steps"] > 0
        assert run["tau"] >= 1.0
        assert run["tau"] == pytest.approx(1 + sum(n * c for n, c in enumerate(histogram)) / sum(histogram), abs=1e-4)
        assert run["speedup"] > 0 and run["ideal_speedup"] > 0
    loss = report["head_loss"]
    assert math.isfinite(loss["kl"]) and loss["kl"] >= 0 and 0.0 <= loss["top1"] <= 1.0
    assert loss["positions"] == sum(v["positions"] for v in loss["by_temperature"].values()) > 0
    assert report["gap_flag"] is False and report["top1_gap"] is None  # no trainer top-1 given
    assert report["greedy_acceptance_0"] == report["runs"][0]["acceptance_per_position"][0]
    recommended = report["recommended_k"]["by_batch_size"]
    assert sorted(recommended, key=int) == ["1", "8", "32"]
    assert all(1 <= r["k"] <= 3 and sorted(r["predicted_speedup"]) == ["1", "2", "3"] for r in recommended.values())
    assert all(r["predicted_speedup"][str(r["k"])] == max(r["predicted_speedup"].values()) for r in recommended.values())
    json.dumps(report)


def test_the_trainers_head_is_left_as_it_was(report, trainer_head):
    assert trainer_head.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trainer_head.parameters())


def test_recomputed_head_logits_are_the_drafters_own(stories_model):
    """After one prefill step the drafter holds the head's logits at the last position, reading (t_n, h_{n-1})."""
    head = init_head_from_target(stories_model, "stories260K")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # perturbed, so that the token the head reads matters (the untrained one ignores it)
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    head = serving_head(head, stories_model)
    engine = Engine(stories_model, config=EngineConfig(num_pages=16, num_draft_tokens=2))
    engine.attach_drafter("mtp", head)
    request = engine.add_request([1, 300, 301, 302, 303, 304], SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()  # prefill, sample t_6, drafter catches up over positions 0..5
    head_logits, target_logits = aligned_logits(stories_model, head, request.token_ids)
    assert head_logits.shape == target_logits.shape == (6, 512)
    torch.testing.assert_close(head_logits[-1], engine.drafter.carried_logits(request.request_id), atol=1e-5,
                               rtol=1e-5)


def test_top1_gap_flags_more_than_two_points():
    assert top1_gap(None, 0.5) == (None, False)
    assert top1_gap(0.5, None) == (None, False)
    assert top1_gap(0.52, 0.50)[1] is False  # exactly 2 points is not over
    assert top1_gap(0.521, 0.50)[1] is True
    assert top1_gap(0.479, 0.50)[1] is True  # the runtime beating the trainer is a mismatch too
    gap, flag = top1_gap(0.6, 0.55)
    assert gap == pytest.approx(0.05) and flag


def test_engine_target_head_folder_and_gap_warning(stories_hf_dir, head_dir, capsys):
    engine = Engine.from_pretrained(stories_hf_dir, num_pages=8)
    report = validate_head(engine, head_dir, DEFAULT_PROMPTS[:2], k=2, temperatures=(0.0,), max_new_tokens=8,
                           batch_size=2, repeats=1, trainer_top1=1.0)
    assert report["gap_flag"] is True and report["top1_gap"] > 0.02  # an untrained head accepts far below 100%
    assert "warning: trainer top-1 1.0000" in capsys.readouterr().err


def test_a_head_for_another_target_is_refused(stories_model, stories_hf_dir, tmp_path):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    with pytest.raises(HeadLoadError, match="trained against"):
        validate_head(stories_hf_dir, init_head_from_target(other, "other"), DEFAULT_PROMPTS[:1], max_new_tokens=2)


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
    assert report["num_prompts"] == 2 and report["trainer_top1"] == 0.42
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


@pytest.mark.parametrize("hidden_state", ["pre_norm", "post_norm"])
def test_training_validation_and_serving_feed_a_head_the_same_hidden_state(stories_model, stories_hf_dir,
                                                                          hidden_state):
    """The trainer's top-1 and KL (UnrolledHead on the stored pre-norm states), validation's recomputed ones and the
    drafter's carry in the engine are one function for either input; feeding the other state changes the logits."""
    from mtp_train.config import compose_training  # noqa: PLC0415
    from mtp_train.data import PackedBatch  # noqa: PLC0415
    from mtp_train.heads import build_head  # noqa: PLC0415
    from mtp_train.target import load_target  # noqa: PLC0415
    from mtp_train.unroll import LossWeights, UnrolledHead  # noqa: PLC0415
    from mtp_train.validate import head_loss  # noqa: PLC0415
    from infer.attention import PackedCausalAttention  # noqa: PLC0415

    cfg = compose_training([f"model.path={stories_hf_dir}", f"head.hidden_state={hidden_state}"], complete=False)
    target = load_target(cfg.model, torch.float32)
    head = build_head(target, cfg.head, str(stories_hf_dir))
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(4)))
    ids = torch.randint(3, 512, (40,), generator=torch.Generator().manual_seed(5))
    stored = stories_model(ids, torch.arange(40), PackedCausalAttention([40]), [None] * 5).hidden_states
    objective = UnrolledHead(head, target.norm_weight, target.eps, 1, LossWeights(kl=1.0, ce=0.0))
    with torch.no_grad():
        _, stats = objective(PackedBatch(ids, stored, torch.ones(40, dtype=torch.bool), [40], [0]), torch.tensor([39.]))
    served = serving_head(head, stories_model)
    assert served.config.hidden_state == hidden_state
    recomputed = head_loss(stories_model, served, [ids.tolist()])
    assert recomputed["positions"] == 39
    assert stats[0, 2].item() / 39 == recomputed["top1"]
    assert stats[0, 0].item() / 39 == pytest.approx(recomputed["kl"], rel=1e-5)

    engine = Engine(stories_model, config=EngineConfig(num_pages=16, num_draft_tokens=2))
    engine.attach_drafter("mtp", served)
    request = engine.add_request(ids[:12].tolist(), SamplingParams(max_new_tokens=2, ignore_eos=True))
    engine.step()  # prefill; the drafter catches up over positions 0..11
    head_logits, _ = aligned_logits(stories_model, served, request.token_ids)
    carry = engine.drafter.carried_logits(request.request_id)
    torch.testing.assert_close(head_logits[-1], carry, atol=1e-5, rtol=1e-5)
    other = "pre_norm" if hidden_state == "post_norm" else "post_norm"
    served.config = dataclasses.replace(served.config, hidden_state=other)
    assert (aligned_logits(stories_model, served, request.token_ids)[0][-1] - carry).abs().max() > 1e-3
