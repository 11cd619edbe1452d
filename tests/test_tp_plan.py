"""mtp_train.memory_plan's tensor-parallel plan, from the configs' shapes on the meta device (no weights): the 70B
target fits one node of 8 x 80 GB for precompute, online training and validation in training, at degrees that split
its heads."""

from __future__ import annotations

import pytest
import torch

from data_tools.config import compose
from mtp_train.config import compose_training
from mtp_train.memory_plan import GIB, HEADROOM, main, precompute_terms, tp_plan, validation_terms

# Llama-3.1-70B's shapes (conf/model/llama3_1_70b.yaml)
H, V, I, L, HEADS, KV_HEADS, D = 8192, 128256, 28672, 80, 64, 8, 128


def params_per_rank(tp: int) -> int:
    """By hand: embedding and lm_head (untied), attention and MLP split over tp ranks; the norms on every rank."""
    split = 2 * V * H + L * (2 * H * HEADS * D + 2 * H * KV_HEADS * D + 3 * H * I)
    return split // tp + (2 * L + 1) * H


@pytest.fixture(scope="module")
def plan_70b():
    cfg = compose_training(["model=llama3_1_70b", "trainer=zero3"], complete=False)
    return cfg, tp_plan(cfg)


def test_the_70b_plan_fits_8_gpus_at_degrees_that_split_its_heads(plan_70b):
    cfg, plans = plan_70b
    assert cfg.validate.enabled and cfg.validate.tp == 8  # conf/recipe/llama3_1_70b.yaml: served over the 8 trainer GPUs
    budget = 80 * GIB * (1 - HEADROOM)
    for key in ("precompute", "validation", "validation_configured", "training"):
        assert plans[key].fits and 0 < plans[key].total <= budget, key
    precompute, validation = plans["precompute"], plans["validation"]
    assert (precompute.tp, validation.tp, plans["validation_configured"].tp) == (2, 4, 8)
    assert all(HEADS % plan.tp == 0 and KV_HEADS % plan.tp == 0 for plan in (precompute, validation))
    pc = compose("precompute", ["model=llama3_1_70b"], complete=False).precompute
    assert sum(precompute_terms(cfg, pc, 1, torch.bfloat16).values()) > budget  # the smaller degrees do not fit
    two = sum(validation_terms(cfg, 2, torch.bfloat16, 1024).values()) + validation.terms["training_state"]
    assert two > budget


def test_the_plans_terms_match_hand_computation(plan_70b):
    _, plans = plan_70b
    for plan in (plans["precompute"], plans["validation_configured"]):
        assert plan.terms["target_shard"] == params_per_rank(plan.tp) * 2  # bf16
    kv_per_token = L * 2 * (KV_HEADS // 2) * D * 2  # K and V of this rank's KV heads, every layer, bf16
    assert plans["precompute"].terms["kv_pages"] == (8192 // 16 + 256) * 16 * kv_per_token
    assert plans["validation"].terms["gathered_head"] == 989_896_704 * 2  # ZeRO-3 gathers the whole bf16 head


def test_memory_plan_prints_each_stage_with_its_degree(capsys):
    assert main(["model=deepseek_v2_lite"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  precompute") or line.startswith("  validation")]
    assert len(lines) == 2 and all("tp=1" in line and " fits " in line for line in lines), out
    assert "target shard 29.26" in lines[0]  # 15.7 B parameters in bf16 on one GPU


def test_the_70b_online_plan_fits_at_tp_4_and_not_at_2(plan_70b):
    """features=online: two copies of the 70B target over 4 GPUs each fit 8 x 80 GB beside the head's ZeRO share,
    the KV pool of one capture batch and the activations; at tp=2 the 70 GB shard alone leaves no room."""
    cfg, plans = plan_70b
    online = plans["online"]
    assert online.fits and online.tp == cfg.online.tp == 4 and "online_configured" not in plans
    assert online.terms["target_shard"] == params_per_rank(4) * 2  # bf16 (conf/recipe: online.model_dtype)
    kv_per_token = L * 2 * (KV_HEADS // 4) * D * 2
    assert online.terms["kv_pages"] == (8192 // 16 + 256) * 16 * kv_per_token
    assert online.terms["head_zero_share"] == plans["validation"].terms["training_state"]
    budget = 80 * GIB * (1 - HEADROOM)
    two = compose_training(["model=llama3_1_70b", "trainer=zero3", "online.tp=2"], complete=False)
    at_two = tp_plan(two)["online_configured"]
    assert at_two.tp == 2 and not at_two.fits and at_two.total > budget
