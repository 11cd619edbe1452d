"""A runner serves the model it is given as it is; the loaders make a model lean (`infer.loader.serve_lean`)."""

from __future__ import annotations

import pytest
import torch

from infer.engine import Engine, EngineConfig
from infer.loader import load_model, serve_lean
from infer.model_runner import ModelRunner
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
