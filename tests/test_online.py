"""features=online (mtp_train.online) against precomputed features, on two gloo ranks in one job (tests/online_parity.py):
the same records, features bitwise equal and 20 losses equal at online.tp=1 and 2; another target is refused on resume;
bad settings are one-line errors naming the key. A killed and resumed online run: tests/test_train_trust.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from data_tools.config import ConfigError
from mtp_train.config import compose_training
from mtp_train.heads import build_head
from data_tools.tokenize import TokenizedRecord
from mtp_train.online import OnlineError, check_online, fits_target
from mtp_train.target import load_target
from tests.test_train_run import ROOT, _env

STEPS = 20


@pytest.fixture(scope="module")
def parity(tmp_path_factory, stories_hf_dir) -> dict:
    out = tmp_path_factory.mktemp("online")
    cmd = [sys.executable, "-m", "mtp_train.torchrun", "--standalone", "--nproc_per_node", "2", "-m",
           "tests.online_parity", str(out), str(stories_hf_dir)]
    result = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.parametrize("t", [1, 2])
def test_online_trains_on_the_features_and_losses_of_precomputed_ones(parity, t):
    """online.tp=t against precompute.tp=t shards of the same records, one record per forward on both sides: the same
    records per step and rank, features bitwise equal, the 20 losses equal within 1e-6; with online's default packing
    and records prefilled only to a shorter trainer.seq_len the features stay within 1e-5 of their range. The control
    (features rounded to bf16) moves the losses."""
    run = parity[f"t{t}"]
    assert run["same_records"] and run["bitwise"]
    assert len(run["offline"]) == len(run["online"]) == STEPS
    assert run["online"] == pytest.approx(run["offline"], rel=1e-6, abs=1e-6)
    assert run["packed_max_diff_over_range"] <= 1e-5 and set(run["packed_rows"]) == {40}  # prefilled to seq_len
    assert parity["control_bf16"] != pytest.approx(parity["t1"]["online"][:3], rel=1e-6, abs=1e-6)


def test_the_step_split_is_logged_when_asked(parity):
    """trainer.time_phases: the target's forwards (data_s), the head's forward and backward, the optimizer, each
    positive, their sum within the step's time; without it the keys are absent."""
    for phases in parity["t1"]["phases"]:
        parts = [phases[k] for k in ("data_s", "head_s", "optimizer_s")]
        assert all(p > 0 for p in parts) and sum(parts) <= phases["tokens"] / phases["tokens_per_s"]
    assert parity["without_phases"] == []


def test_records_too_long_for_the_target_are_a_counted_skip_or_a_one_line_error(capsys):
    records = [TokenizedRecord(f"r{n}", [1] * n, [1] * n) for n in (4, 9, 8)]
    assert [r.source for r in fits_target(records, 8, "skip")] == ["r4", "r8"]
    assert "skipped 1 of 3 records longer than the target's max_position_embeddings=8 (first: r9)" in capsys.readouterr().err
    with pytest.raises(OnlineError, match="record r9 has 9 tokens, more than the target's max_position_embeddings=8"):
        fits_target(records, 8, "fail")
    assert fits_target(records, 9, "fail") == records  # the control: all fit


def test_resuming_with_another_target_is_refused_naming_the_key(parity):
    message = parity["other_target"]
    assert message is not None and "\n" not in message and "features" in message


def test_online_tp_must_divide_the_ranks():
    cfg = compose_training(["features=online", "online.tp=3"])
    with pytest.raises(ConfigError, match=r"online\.tp=3 must divide the 2 training ranks"):
        check_online(cfg, 2)
    check_online(compose_training(["features=online", "online.tp=2"]), 2)  # the control: 2 divides 2


def test_offline_without_features_dir_and_a_head_layer_the_target_lacks_name_the_key(stories_hf_dir):
    with pytest.raises(ConfigError, match="features_dir is not set"):
        compose_training([])
    compose_training(["features=online"])  # the control: online needs no features_dir
    target = load_target(compose_training(["features=online", f"model.path={stories_hf_dir}"]).model, torch.float32)
    for layer_ids, fails in (([1, 2, 9], True), ([1, 2, 5], False)):
        head = compose_training(["features=online", "head=eagle3", f"head.layer_ids={layer_ids}",
                                 f"model.path={stories_hf_dir}"]).head
        if fails:
            with pytest.raises(ValueError, match=r"head\.layer_ids=\[1, 2, 9\]"):
                build_head(target, head, str(stories_hf_dir), torch.float32)
        else:
            build_head(target, head, str(stories_hf_dir), torch.float32)
