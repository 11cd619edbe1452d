"""The trainer's replay (mtp_train.validate.trainer_replay) recomputes the runtime's greedy conditional acceptance of
a head fitted in the test (tests/fitted_head.py), position by position: an untrained head accepts nothing on either
side, so only a head that drafts can show a replay that walks the verify steps wrongly (a mutated walk, an anchor
read one off, moves the figures by 2.7-12 points and is flagged)."""

from __future__ import annotations

import pytest
import torch

from infer.engine import Engine
from infer.prompts import VALIDATION_PROMPTS
from mtp_train.validate import GAP_POINTS, validate_head
from tests.fitted_head import TRAIN_PROMPTS, fit_head

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def fitted_report(stories_hf_dir) -> dict:
    engine = Engine.from_pretrained(stories_hf_dir, dtype=torch.float32, device="cpu")
    head = fit_head(engine)
    return validate_head(engine, head, VALIDATION_PROMPTS[:8], k=3, temperatures=(0.0,), max_new_tokens=48,
                         batch_size=8, repeats=1, recommend_for=(), ideal=False)


def test_the_fitted_head_drafts_on_openings_it_was_not_fitted_on(fitted_report):
    assert not set(VALIDATION_PROMPTS[:8]) & set(TRAIN_PROMPTS)
    (run,) = fitted_report["runs"]
    assert all(a > 0.25 for a in run["conditional_acceptance"]), run["conditional_acceptance"]
    assert run["reached"][-1] > 30  # enough verify steps reach the last position to weigh it


def test_the_replay_recomputes_the_runtimes_acceptance_at_every_position(fitted_report):
    (run,) = fitted_report["runs"]
    replay = fitted_report["trainer_replay"]["at_verify_steps"]
    assert replay == pytest.approx(run["conditional_acceptance"], abs=GAP_POINTS)
    assert fitted_report["gap_flag"] is False
