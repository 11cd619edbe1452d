"""A runner serves the model it is given as it is (the loaders make a model lean: `infer.loader.serve_lean`), and
plans runs of plain decode steps where its backend allows (`DecodeRuns`)."""

from __future__ import annotations

import pytest
import torch

from infer.attention import FlashInferAttention, kv_buckets
from infer.engine import Engine, EngineConfig
from infer.kv_cache import DecodeSteps
from infer.loader import load_model, serve_lean
from infer.model_runner import DECODE_RUN_MAX_SEQS, DecodeRuns, ModelRunner
from infer.models.llama import LlamaDecoderLayer
from infer.models.mtp_head import init_head_from_target, load_head, save_head
from infer.sampling_params import SamplingParams
from tests.test_engine import REFERENCE_STORY

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def full_dispatch(model: torch.nn.Module) -> bool:
    return all(type(m).__call__ is torch.nn.Module.__call__ for m in model.modules())


def test_a_runner_leaves_the_model_it_is_given_as_it_is(stories_hf_dir, stories_model, tmp_path):
    """Constructing a runner swaps no class of a model its caller holds; the loaders serve theirs lean (a target,
    a head folder), and a model loaded with lean=False keeps nn.Module's full dispatch (the control)."""
    model = load_model(stories_hf_dir, lean=False)
    ModelRunner(model, 8, 4, "torch")
    assert full_dispatch(model)
    assert not any(full_dispatch(m) for m in stories_model.model.layers)
    folder = save_head(init_head_from_target(model, "stories260K"), tmp_path / "head")
    assert not full_dispatch(load_head(folder, model))
    assert full_dispatch(load_head(folder, model, lean=False))


def test_a_lean_model_keeps_hooks_weights_and_assignments(stories_hf_dir, stories_tokenizer):
    """serve_lean takes nn.Module's call and lookup machinery out of the forward (a sixth of a small decode step):
    a module hooked before it keeps its hook, class identities and checkpoint names stay, and a parameter assigned
    afterwards is the one the forward uses."""
    model = load_model(stories_hf_dir, lean=False)
    names = list(model.state_dict())
    outputs = []
    model.model.layers[2].register_forward_hook(lambda module, args, out: outputs.append(out.shape[0]))
    assert serve_lean(model) is model
    engine = Engine(model, None, [], EngineConfig(page_size=4, num_pages=32, backend="torch"))
    (request,) = engine.generate([[1]], SamplingParams(max_new_tokens=12))
    assert REFERENCE_STORY.startswith(stories_tokenizer.decode(request.output_ids))
    assert outputs == [1] * 12  # the hooked layer ran its hook at every step (prefill of BOS, then 11 decodes)
    hooked, plain = model.model.layers[2], model.model.layers[1]
    assert type(hooked).__call__ is torch.nn.Module.__call__
    assert type(plain).__call__ is not torch.nn.Module.__call__ and isinstance(plain, LlamaDecoderLayer)
    assert list(model.state_dict()) == names
    mlp = plain.mlp
    mlp.down_proj.weight = torch.nn.Parameter(torch.zeros_like(mlp.down_proj.weight))
    mlp.gate_up_proj = torch.nn.Linear(64, 2 * 172, bias=False)
    assert mlp.down_proj.weight.abs().sum() == 0 and mlp(torch.randn(3, 64)).abs().sum() == 0
    assert mlp.gate_up_proj is mlp._modules["gate_up_proj"]


def test_decode_runs_serve_a_batch_step_by_step_while_it_stays_the_same(stories_model):
    """A run's steps go to the same requests in the same order, each one token further; any other batch ends the
    run, and the next may take twice as many steps as the ended one served (up to decode_run_steps). Each step is
    the run's `DecodeSteps` step."""
    runs = ModelRunner(stories_model, 64, 4, "torch", decode_run_steps=4).decode_runs
    pages = [[0, 1, 2], [3, 4, 5]]
    assert runs.next_step([7, 9], [5, 7]) is None and runs.next_steps == 4  # no run yet
    first = runs.start([7, 9], pages, [5, 7], 3)
    reference = DecodeSteps(pages, [4, 6], 3, 4, torch.device("cpu"))
    assert first.positions.tolist() == reference.step(0).positions.tolist() == [4, 6]
    for j in (1, 2):
        meta = runs.next_step([7, 9], [5 + j, 7 + j])
        assert meta.decode_step == j and meta.positions.tolist() == reference.step(j).positions.tolist()
    assert runs.next_step([7, 9], [8, 10]) is None and runs.next_steps == 4  # used up: min(2 * 3, 4)
    runs.start([7, 9], pages, [8, 10], 2)
    assert runs.next_step([9, 7], [10, 9]) is None and runs.next_steps == 2  # another order ends it after one step
    assert runs.next_step([9, 7], [11, 10]) is None  # and no run continues


def test_decode_runs_fit_where_the_backend_attends_a_run_as_its_steps(stories_model):
    """The torch backend attends a run as one group padded to its longest, so a batch whose keys a step would split
    by length (`kv_buckets`) takes no run; FlashInfer plans every step on its own metadata (any batch fits); no
    backend runs past DECODE_RUN_MAX_SEQS sequences, or with decode_run_steps=1."""
    split, even = [16] * 16 + [512] * 16, [512] * 32
    assert len(kv_buckets(list(range(32)), split)) > 1 and len(kv_buckets(list(range(32)), even)) == 1
    torch_runs = ModelRunner(stories_model, 64, 4, "torch").decode_runs
    assert torch_runs.fits(even) and not torch_runs.fits(split)
    flashinfer_runs = DecodeRuns(FlashInferAttention.__new__(FlashInferAttention), 16, 4, torch.device("cpu"))
    assert flashinfer_runs.fits(even) and flashinfer_runs.fits(split)
    assert not flashinfer_runs.fits([8] * (DECODE_RUN_MAX_SEQS + 1)) and torch_runs.fits([8] * DECODE_RUN_MAX_SEQS)
    assert not ModelRunner(stories_model, 64, 4, "torch", decode_run_steps=1).decode_runs.fits(even)
