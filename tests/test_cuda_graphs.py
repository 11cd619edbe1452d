"""The CUDA-graph path tested on a CPU (`infer.cuda_graphs`, mode "padded": the padding and static buffers a GPU
replays, run eagerly): padded batches give the unpadded tokens through the engine (plain decode, and an EAGLE-3
head's catch-up, drafts and the verify), the buffers the model reads keep their addresses, and every callable a GPU
would capture compiles as one graph (no host read). Each check has a control that fails it."""

from __future__ import annotations

import pytest
import torch

from infer.cuda_graphs import GraphRunner, capture_sizes
from infer.engine import Engine, EngineConfig
from infer.models.mtp_head import init_head_from_target
from infer.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["Once upon a time", "The cat sat on the", "Lily went to the park and", "Tom had a red", "One day, a"]
PARAMS = [SamplingParams(max_new_tokens=n, temperature=t, seed=s, ignore_eos=True)
          for n, t, s in ((60, 0.0, None), (44, 0.8, 3), (64, 0.0, None), (36, 1.0, 5), (52, 0.0, None))]


def engine(model, tokenizer, mode: str, head=None) -> Engine:
    eng = Engine(model, tokenizer, [2], EngineConfig(backend="torch", page_size=8, num_pages=96, cuda_graphs=mode,
                                                      num_draft_tokens=3))
    if head is not None:
        eng.attach_drafter("eagle3", head)
    return eng


@pytest.fixture(scope="module")
def head(stories_model):
    return init_head_from_target(stories_model, "stories260K", "eagle3")


class Recorder:
    """Wraps a GraphRunner's model: the keys served and the addresses of what the model read."""

    def __init__(self, graphs: GraphRunner) -> None:
        self.graphs, self.model, self.keys, self.pointers = graphs, graphs.model, [], set()
        graphs.model = self
        run = graphs.run

        def recording_run(key, *args):
            self.keys.append(key)
            return run(key, *args)

        graphs.run = recording_run

    def __call__(self, input_ids, positions, attn, kv_caches, logits_indices, **extra):
        hidden = extra["hidden_states"].data_ptr() if "hidden_states" in extra else 0
        self.pointers.add((input_ids.data_ptr(), positions.data_ptr(), attn.block_table.data_ptr(),
                           attn.k_rows.data_ptr(), hidden))
        return self.model(input_ids, positions, attn, kv_caches, logits_indices, **extra)


@pytest.fixture(scope="module")
def runs(stories_model, stories_tokenizer, head):
    """(eager outputs, padded outputs, padded engine, recorders) of plain and speculative runs."""
    out = {}
    for drafter in (None, head):
        eager_engine = engine(stories_model, stories_tokenizer, "off", drafter)
        eager = [r.output_ids for r in eager_engine.generate(PROMPTS, PARAMS)]
        padded = engine(stories_model, stories_tokenizer, "padded", drafter)
        recorders = [Recorder(padded.runner.graphs)] + ([Recorder(padded.drafter.runner.graphs)] if drafter else [])
        tokens = [r.output_ids for r in padded.generate(PROMPTS, PARAMS)]
        out["spec" if drafter else "plain"] = (eager, tokens, padded, recorders)
    return out


def test_capture_sizes_cover_every_batch_up_to_the_largest():
    assert capture_sizes(64)[:5] == [1, 2, 3, 4, 8] and capture_sizes(64)[-1] == 64
    assert capture_sizes(5) == [1, 2, 3, 4, 8] and capture_sizes(200)[-1] == 200


@pytest.mark.parametrize("kind", ["plain", "spec"])
def test_padded_batches_give_the_unpadded_tokens(runs, kind):
    eager, padded, eng, recorders = runs[kind]
    assert padded == eager
    for recorder in recorders:  # every forward class went through the padded path, with padding (5 -> 8 requests)
        assert recorder.keys and any(key.batch == 8 for key in recorder.keys)
    if kind == "spec":
        q_lens = {(key.q_len, key.with_hidden) for r in recorders for key in r.keys}
        assert {(4, False), (1, True), (4, True)} <= q_lens  # verify, drafts, catch-up (decode: the plain run's)
        assert eng.spec_stats.verify_steps > 10


def test_padded_rows_that_write_a_real_page_change_the_tokens(stories_model, stories_tokenizer, runs):
    """The control: padded requests writing page 0 (a request's) instead of the dummy page."""
    eng = engine(stories_model, stories_tokenizer, "padded")
    graphs = eng.runner.graphs
    graphs.dummy_page = 0
    graphs._pad = (graphs._pad[0], graphs._pad[0].clone())  # rows of page 0
    assert [r.output_ids for r in eng.generate(PROMPTS, PARAMS)] != runs["plain"][0]


def test_static_buffers_keep_their_addresses(stories_model, stories_tokenizer, runs):
    _, _, _, recorders = runs["spec"]
    for recorder in recorders:
        assert len(recorder.keys) >= 50 and len(recorder.pointers) == 1
    # the control: the eager path's forwards read fresh tensors
    eng = engine(stories_model, stories_tokenizer, "off")
    seen, run = set(), eng.runner.forward
    eng.runner.forward = lambda ids, *a, **kw: seen.add(ids.data_ptr()) or run(ids, *a, **kw)
    eng.generate(PROMPTS, PARAMS)
    assert len(seen) > 1


def test_each_captured_callable_compiles_as_one_graph(runs):
    """Each forward class's callable, on the buffers as its last step left them, traced whole (an eager backend:
    no C++ compiler); its outputs equal the eager call's. The control: a host read in the model's forward breaks
    the trace."""
    _, _, _, recorders = runs["spec"]
    for recorder in recorders:
        graphs = recorder.graphs
        graphs.model = recorder.model
        forward = graphs.callable(recorder.keys[-1])  # the target's verify, the head's draft
        expected = forward()
        torch._dynamo.reset()
        got = torch.compile(forward, fullgraph=True, backend="eager")()
        torch.testing.assert_close(got.logits, expected.logits)
        torch.testing.assert_close(got.hidden_states, expected.hidden_states)
    graphs = recorders[0].graphs
    model = graphs.model
    graphs.model = lambda ids, *args, **kw: model(ids if bool(ids.max() >= 0) else ids.flip(0), *args, **kw)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="(?i)data.dependent"):
        torch.compile(graphs.callable(recorders[0].keys[-1]), fullgraph=True, backend="eager")()
    graphs.model = model
