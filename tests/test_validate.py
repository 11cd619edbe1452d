"""Head validation through infer's Engine (mtp_train.validate) on stories260K.

- The report of an untrained head (the target's last layer) has the structure the trainer and the CLI read, with
  the identities that hold by construction: conditional acceptance (accepted / reached) in [0, 1] with its standard
  error, the unconditional share non-increasing over draft positions (a draft is accepted only after the one before
  it), the histogram summing to the verify steps, tau = 1 + its mean, the trainer's figures on the greedy text within
  2 points of the runtime's. The trainer's in-memory head is left as it was (mode, grads, dtype).
- Conditional acceptance and its error from a histogram; the gap flag: more than 2 points at any position.
- The CLI writes report.json and PNGs, reads MT-bench-style prompt files and the run's metrics.jsonl, skips the K
  recommendation when asked, and turns user mistakes into one-line errors with exit 2.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from infer.attention import PackedCausalAttention
from infer.cli import run_cli
from infer.engine import Engine, EngineConfig
from infer.models.mtp_head import HeadLoadError, init_head_from_target, save_head
from infer.prompts import VALIDATION_PROMPTS
from infer.sampling_params import SamplingParams
from infer.speculative import SpecStats
from mtp_train.validate import main, replay_gap, serving_head, validate_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
FAST = ["--num-draft-tokens", "2", "--max-new-tokens", "12", "--batch-size", "4", "--repeats", "1",
        "--recommend-for", "2"]


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
        assert min(run["plain_host_ms"], run["spec_forward_ms"], run["spec_host_ms"]) > 0  # a CPU's step split
    replay = report["trainer_replay"]
    assert len(replay["top1"]) == len(replay["cond_top1"]) == len(replay["at_verify_steps"]) == 3 > 0 < replay["positions"]
    assert math.isfinite(replay["kl"][0]) and replay["kl"][0] >= 0
    assert len(report["replay_gap"]) == 3 and report["gap_flag"] is False  # the trainer computes what is served
    assert report["distinct_prompts"] == report["num_prompts"] == 4
    recommended = report["recommended_k"]["by_batch_size"]
    assert sorted(recommended, key=int) == ["1", "8", "32"]
    for r in recommended.values():  # the best K, or 0 where plain decoding is predicted faster than every K
        best = max(r["predicted_speedup"].values())
        assert sorted(r["predicted_speedup"]) == ["1", "2", "3"] and 0 <= r["k"] <= 3
        assert best <= 1.0005 if r["k"] == 0 else r["predicted_speedup"][str(r["k"])] == best >= 0.9995
    json.dumps(report)


def test_the_trainers_head_is_left_as_it_was(report, trainer_head):
    assert trainer_head.training
    assert all(p.requires_grad and p.dtype == torch.float32 for p in trainer_head.parameters())


def test_validation_prompts_are_64_distinct_openings():
    assert len(VALIDATION_PROMPTS) == len(set(VALIDATION_PROMPTS)) == 64


def conditional_acceptance(histogram: list[int]) -> tuple[list[float], list[float], list[int]]:
    """SpecStats' figures for an accepted-length histogram (steps that accepted exactly n drafts)."""
    stats = SpecStats(len(histogram) - 1)
    for accepted, steps in enumerate(histogram):
        for _ in range(steps):
            stats.record(accepted)
    return (*stats.conditional_acceptance(), stats.reached())


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


def test_engine_target_and_head_folder_without_ideal_or_recommendation(stories_hf_dir, head_dir):
    """The trainer's validations: an Engine as the target, no forward costs timed (no ideal) and no K recommended;
    the runs are measured and timed all the same."""
    engine = Engine.from_pretrained(stories_hf_dir, num_pages=8)
    report = validate_head(engine, head_dir, VALIDATION_PROMPTS[:2], k=2, temperatures=(0.0,), max_new_tokens=8,
                           batch_size=2, repeats=1, recommend_for=(), ideal=False)
    assert report["head"] == str(head_dir)
    (run,) = report["runs"]
    assert run["verify_steps"] > 0 and run["speedup"] > 0
    assert run["ideal_speedup"] is None and run["achieved_over_ideal"] is None
    assert report["forward_ms"] == {} and report["recommended_k"] == {"by_batch_size": {}, "from": None}


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
    assert list(report["recommended_k"]["by_batch_size"]) == ["2"]  # --recommend-for
    assert f"recommended K at batch 2: {report['recommended_k']['by_batch_size']['2']['k']}" in printed
    assert report["metrics"] == {"file": str(run_dir / "metrics.jsonl"), "records": 5, "skipped_lines": 1}
    assert sorted(report["plots"]) == ["acceptance_per_position.png", "accepted_length_histogram.png",
                                       "training_curves.png"]
    for name in report["plots"]:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_cli_recommend_for_none_skips_the_recommendation(stories_hf_dir, head_dir, tmp_path):
    out = tmp_path / "out"
    assert main(["--target", str(stories_hf_dir), "--head", str(head_dir), "--out", str(out), "--temperatures", "0",
                 *FAST, "--recommend-for", "none"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["target"] == str(stories_hf_dir) and report["head"] == str(head_dir)
    assert report["recommended_k"]["by_batch_size"] == {}


@pytest.mark.parametrize("case,message", [
    ("missing_head", "head folder .* does not exist"),
    ("other_target", "trained against 'other'"),
    ("one_token", "max_new_tokens must be >= 2 .*speculation starts at the second"),
    ("bad_batch_sizes", "--recommend-for takes comma-separated integers, got '1,eight'"),
])
def test_cli_user_mistakes_are_one_line_errors(stories_model, stories_hf_dir, tmp_path, capsys, case, message):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    foreign = save_head(init_head_from_target(other, "other"), tmp_path / "foreign")
    argv = {
        "missing_head": ["--target", str(stories_hf_dir), "--head", str(tmp_path / "nope")],
        "other_target": ["--target", str(stories_hf_dir), "--head", str(foreign)],
        "one_token": ["--target", str(stories_hf_dir), "--head", str(foreign), "--max-new-tokens", "1"],
        "bad_batch_sizes": ["--target", str(stories_hf_dir), "--head", str(foreign), "--recommend-for", "1,eight"],
    }[case]
    assert run_cli(lambda: main(["--out", str(tmp_path / "out"), *FAST, *argv])) == 2  # argv's flags win
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")
    import re

    assert re.search(message, err), err


@torch.inference_mode()
def aligned_logits(model, head, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(head logits [n-1, V] at positions 0..n-2 reading the target's states as the head does, the target's logits
    [n-1, V] at positions 1..n-1): one sequence, no KV cache, an independent replay of what the drafter serves."""
    ids = torch.tensor(token_ids, dtype=torch.long)
    positions = torch.arange(len(token_ids))
    target_out = model(ids, positions, PackedCausalAttention([len(token_ids)]), [None] * len(model.model.layers))
    head_out = head(ids[1:], positions[:-1], PackedCausalAttention([len(token_ids) - 1]), [None],
                    hidden_states=head.features(target_out.hidden_states[:-1]))
    return head_out.logits, target_out.logits[1:]


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
    from mtp_train.validate import trainer_replay  # noqa: PLC0415

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
    recomputed = trainer_replay(stories_model, served, [ids.tolist()], [0], 1)  # every position counted
    assert recomputed["positions"] == 39
    assert round(stats[0, 2].item() / 39, 4) == recomputed["top1"][0]
    assert round(stats[0, 0].item() / 39, 4) == pytest.approx(recomputed["kl"][0], abs=1e-4)

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


def test_report_names_a_recommended_k_of_0_plain_decoding():
    from mtp_train.report import format_report  # noqa: PLC0415

    run = {"temperature": 0.0, "tau": 1.5, "conditional_acceptance": [0.5], "conditional_acceptance_se": [0.05],
           "speedup": 0.9, "ideal_speedup": 1.0, "plain_tok_s": 100.0, "spec_tok_s": 90.0}
    recommended = {"1": {"k": 1, "predicted_speedup": {"1": 1.1}}, "8": {"k": 0, "predicted_speedup": {"1": 0.93}}}
    text = format_report({"num_draft_tokens": 1, "runs": [run], "trainer_replay": None,
                          "recommended_k": {"by_batch_size": recommended}})
    assert "recommended K at batch 1: 1 (predicted speedup K=1: 1.10)" in text
    assert "recommended K at batch 8: 0, plain decoding (predicted speedup K=1: 0.93)" in text
