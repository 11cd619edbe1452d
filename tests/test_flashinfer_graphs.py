"""FlashInfer inside the graph runner, on a CPU (`infer.attention.flashinfer_graphs`; `tests/fake_flashinfer.py` stands
in for the package, and in its cudagraph mode attends from nothing but its fixed buffers, as a replayed kernel
does). Through the padded path (mode "padded": what a GPU captures, run eagerly) the FlashInfer backend gives the
eager torch backend's tokens, plain and speculative (an EAGLE-3 head: verify through the prefill wrapper, drafts
through the decode wrapper); each forward is planned once, on the host, before its layers run, and the captured
callable itself plans nothing; the wrappers read buffers that keep their addresses. The control: planning a wrapper
only on its first forward (stale buffers at every later replay) changes the tokens. The padded plan puts padded
requests on the dummy page, and a plan refuses to run while the stream captures."""

from __future__ import annotations

import sys

import pytest
import torch

import infer.attention.flashinfer_backend
import infer.attention.flashinfer_graphs
from infer.attention.flashinfer_graphs import FlashInferGraphAttention, padded_plan
from infer.bench.graph_check import eagle3_head_for
from infer.engine import Engine, EngineConfig
from infer.kv_cache import build_page_metadata
from infer.sampling_params import SamplingParams
from tests import fake_flashinfer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = [[1, 400, 301, 280], [1, 65, 300, 259, 270], [1, 259], [1, 30, 31, 32, 33, 34], [1, 90, 91]]
PARAMS = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 14, 24, 10, 17)]


@pytest.fixture(scope="module")
def fake():
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "flashinfer", fake_flashinfer)
        patch.setattr(infer.attention.flashinfer_backend, "flashinfer_available", lambda: True)
        yield fake_flashinfer


@pytest.fixture(scope="module")
def head(stories_model):
    return eagle3_head_for(stories_model, "stories260K", draft_vocab=256)


def generate(model, backend: str, graphs: str, head=None) -> tuple[list, Engine]:
    engine = Engine(model, None, [], EngineConfig(backend=backend, page_size=8, num_pages=64, cuda_graphs=graphs,
                                                  num_draft_tokens=3))
    if head is not None:
        engine.attach_drafter("eagle3", head)
    return [r.output_ids for r in engine.generate(PROMPTS, PARAMS)], engine


@pytest.fixture(scope="module")
def runs(fake, stories_model, head):
    """kind -> (eager torch tokens, FlashInfer padded-graph tokens, that engine, the fake's calls during it)."""
    out = {}
    for kind, drafter in (("plain", None), ("spec", head)):
        eager, _ = generate(stories_model, "torch", "off", drafter)
        fake.CALLS.clear()
        tokens, engine = generate(stories_model, "flashinfer", "padded", drafter)
        out[kind] = (eager, tokens, engine, list(fake.CALLS))
    return out


def runners(engine: Engine) -> list:
    return [engine.runner.graphs] + ([engine.drafter.runner.graphs] if engine.drafter is not None else [])


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_flashinfer_graphs_give_the_eager_tokens_planned_before_every_replay(runs, kind):
    eager, tokens, engine, calls = runs[kind]
    assert tokens == eager
    graphs = runners(engine)
    assert all(isinstance(g.attn, FlashInferGraphAttention) for g in graphs)
    wrappers = {key for g in graphs for key in g.attn.wrappers}
    assert (8, 1) in wrappers and (1, 1) in wrappers  # padded 5 -> 8, and unpadded
    if kind == "spec":
        assert (8, 4) in wrappers  # the verify's and the catch-up's K+1 rows: the prefill wrapper
    # every graph forward: one plan on the host, then one run per layer reading what it wrote
    graph_calls = [c for c in calls if c[0].startswith("graph-")]
    plans = [i for i, c in enumerate(graph_calls) if c[0] == "graph-plan"]
    assert len(plans) == sum(g.num_runs for g in graphs) == sum(g.attn.num_plans for g in graphs) > 20
    layers = {len(engine.runner.model.model.layers), 1}
    for start, end in zip(plans, plans[1:] + [len(graph_calls)]):
        assert end - start - 1 in layers and all(c[0] == "graph-run" for c in graph_calls[start + 1 : end])
    assert all(c[1] == {"cpu"} for c in graph_calls if c[0] == "graph-plan")


def test_the_captured_callable_plans_nothing_and_the_buffers_keep_their_addresses(runs, fake):
    _, _, engine, _ = runs["spec"]
    for graphs in runners(engine):
        attn = graphs.attn
        fixed = {attn.qo_indptr.data_ptr(), attn.kv_indptr.data_ptr(), attn.kv_indices.data_ptr(),
                 attn.kv_last_page_len.data_ptr()}
        for wrapper in attn.wrappers.values():
            assert len(wrapper.graph.addresses) == 1 and set(next(iter(wrapper.graph.addresses))) <= fixed
        key = graphs.last_key
        fake.CALLS.clear()
        graphs.callable(key)()  # what a capture records: the layers' runs, no plan
        assert fake.CALLS and {c[0] for c in fake.CALLS} == {"graph-run"}


def test_planning_only_the_first_forward_changes_the_tokens(fake, stories_model, runs, monkeypatch):
    """The control: a wrapper planned on its first forward only replays on stale buffers afterwards."""
    plan, planned = FlashInferGraphAttention.plan, set()

    def first_only(self, padded):
        if (id(self), padded.batch, padded.q_len) not in planned:
            planned.add((id(self), padded.batch, padded.q_len))
            plan(self, padded)

    monkeypatch.setattr(FlashInferGraphAttention, "plan", first_only)
    assert generate(stories_model, "flashinfer", "padded")[0] != runs["plain"][0]


def test_the_padded_plan_and_no_plan_inside_a_capture(runs, monkeypatch):
    """A step of one request (2 keys on page 3) padded to 2 requests: the padded one holds its row on the dummy page.
    A plan while the stream captures fails (host work a graph would not record); the same plan outside runs."""
    graphs = runs["plain"][2].runner.graphs
    attn, dummy = graphs.attn, graphs.dummy_page
    padded = padded_plan(build_page_metadata([[3]], [1], [2], 8, torch.device("cpu")), 2, 1, dummy)
    assert [t.tolist() for t in (padded.qo_indptr, padded.kv_indptr, padded.kv_indices, padded.kv_last_page_len)] == [
        [0, 1, 2], [0, 1, 2], [3, dummy], [2, 1]]
    capturing = [True]
    monkeypatch.setattr(attn, "device", torch.device("cuda"))  # the guard's device; the buffers stay on the CPU
    monkeypatch.setattr(infer.attention.flashinfer_graphs, "pinned", lambda host, device: host)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        attn.plan(padded)
    capturing[0], plans = False, attn.num_plans
    attn.plan(padded)
    assert attn.num_plans == plans + 1
