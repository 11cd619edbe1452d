"""The CPU-runnable parts of the GPU check's graph rows (`infer.bench.graph_check`): random models built in place,
their weight bytes, and the oracle drafter, which runs an EAGLE-3 head with a draft vocabulary through the padded
graph path but proposes the target's greedy tokens at a set acceptance: all right gives tau K+1 less the run's end,
none gives tau 1 (the control), and the tokens stay the plain run's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from infer.bench.graph_check import (
    decode_graph_rows, eagle3_head_for, graph_child_command, graph_rows_in_child, oracle_speedup, random_model,
    same_tokens, step_cost_row, weight_bytes,
)
from infer.bench.oracle_drafter import attach_oracle
from infer.engine import Engine, EngineConfig
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


def test_random_model_counts_a_tied_embedding_once():
    model = random_model(TINY, "cpu", torch.float32)
    layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128 + 2 * 64  # qkv, o, gate/up/down, two norms
    assert weight_bytes(model) == 4 * (256 * 64 + 2 * layer + 64)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.model.norm.weight.eq(1).all()


@pytest.mark.parametrize("acceptance", [1.0, 0.0])
def test_the_oracle_drafter_accepts_at_its_set_rate(stories_model, acceptance):
    head = eagle3_head_for(stories_model, "stories260K", draft_vocab=256)
    prompts = [[1, 300, 400, 500], [1, 50, 60]]
    got = oracle_speedup(stories_model, head, prompts, 3, 24, 1, "padded", acceptance, backend="torch")
    if acceptance == 1.0:
        assert got["tau"] > 3.5
    else:
        assert got["tau"] == 1.0


def test_the_oracle_drafter_keeps_the_plain_tokens(stories_model):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    prompts = [[1, 300, 400, 500]]
    config = EngineConfig(num_draft_tokens=2, backend="torch", cuda_graphs="padded", num_pages=32)
    plain = [r.output_ids for r in Engine(stories_model, None, [], config).generate(prompts, params)]
    spec = Engine(stories_model, None, [], config)
    attach_oracle(spec, eagle3_head_for(stories_model, "stories260K", 256), {tuple(prompts[0]): plain[0]}, 0.8)
    assert [r.output_ids for r in spec.generate(prompts, params)] == plain
    assert 1.0 < spec.spec_stats.tau < 3.0


def test_step_costs_run_on_a_cpu(stories_model):
    """The step-cost row's CPU-runnable part (aten ops for kernels); a failing step becomes the row's error, not the
    check's."""
    config = EngineConfig(backend="torch", cuda_graphs="padded", num_pages=32)
    row = step_cost_row(Engine(stories_model, None, [], config), "stories260K", "padded", steps=3)
    assert "kernels" in row["value"] and "a layer" in row["value"] and "host" in row["reference"]
    broken = Engine(stories_model, None, [], config)
    broken.step = None
    assert step_cost_row(broken, "stories260K", "padded", steps=3)["value"].startswith("error:")


def test_decode_rows_run_on_a_cpu_and_compare_tokens():
    rows = decode_graph_rows("tiny", "cpu", [1, 2], 6, 1, shape=TINY, cost_steps=2)
    settings = [r["setting"].split(",")[0] for r in rows]
    assert settings == ["step costs", "step costs", "decode batch 1", "decode batch 1", "decode batch 2"]
    assert rows[3]["setting"] == "decode batch 1, graphs + overlap"  # overlap at batch 1 (and 8), not at 2
    # padded == eager, overlapped == padded
    assert all("equal 2/2" in r["reference"] or "equal 1/1" in r["reference"] for r in rows[2:])
    assert same_tokens([[1, 2, 3], [4, 5]], [[1, 2, 4], [4, 5]]) == "equal 1/2, first differ at 2"  # the control


def test_decode_rows_take_the_flashinfer_graph_path_where_it_imports(monkeypatch):
    """Where FlashInfer imports (the fake here, `tests/fake_flashinfer.py`) the check's graph rows run through its
    graph wrappers and say so; the padded path's tokens equal the eager FlashInfer path's."""
    import infer.attention.flashinfer_backend
    from tests import fake_flashinfer

    monkeypatch.setitem(sys.modules, "flashinfer", fake_flashinfer)
    monkeypatch.setattr(infer.attention.flashinfer_backend, "flashinfer_available", lambda: True)
    fake_flashinfer.CALLS.clear()
    rows = decode_graph_rows("tiny", "cpu", [2], 4, 1, shape=TINY, backend="flashinfer")
    assert "equal 2/2" in rows[0]["reference"] and "FlashInfer graph wrappers" in rows[0]["reference"]
    assert any(call[0] == "graph-plan" for call in fake_flashinfer.CALLS)
    torch_rows = decode_graph_rows("tiny", "cpu", [2], 4, 1, shape=TINY, backend="torch")  # the control
    assert "static-paged SDPA" in torch_rows[0]["reference"]


@pytest.mark.parametrize("case", ["fails", "overruns", "finishes"])
def test_graph_rows_from_a_child_process(case):
    """The GPU check runs its graph rows in a process of its own: its rows come through as they land, and a process
    that fails or overruns ends in one error row (the caller goes on); one that finishes adds none."""
    row = {"check": "graphs", "model": "m", "setting": "s", "value": "1 tok/s", "reference": "", "ratio": ""}
    tail = {"fails": "sys.exit(2)", "overruns": "time.sleep(30)", "finishes": "pass"}[case]
    script = f"import json, sys, time; print('row at 0 s: ' + json.dumps({row!r}), flush=True); {tail}"
    rows = list(graph_rows_in_child([sys.executable, "-c", script], "graphs", timeout_s=1))
    assert rows[0] == row
    expected = {"fails": "code 2", "overruns": "overran 1 s", "finishes": None}[case]
    if expected is None:
        assert len(rows) == 1
    else:
        assert len(rows) == 2 and rows[1]["value"].startswith("error:") and expected in rows[1]["value"]
    assert "--graphs-child" in graph_child_command(Path("s"), ["graphs"], 8, 1)
