"""Block heads in the DFlash layouts (mtp_train.export_dflash): a perturbed block head on stories260K with q/k norms,
a reserved mask id and layer ids out of order is exported in both formats; each folder conforms to every loader
table that serves it (mtp_train.engine_loaders.DFLASH_LOADERS), writes the layer ids in each reader's convention
and fc's column blocks in ascending layer order, and reads back (load_export) into the same head, drafting the
same logits. Controls: a folder missing a k_norm fails the tables; the untouched head's block forward differs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.models.mtp_head import init_head_from_target
from mtp_train.engine_loaders import check, loaders
from mtp_train.export import export_head, load_export
from mtp_train.export_dflash import DFLASH_FORMATS

pytestmark = pytest.mark.usefixtures("one_torch_thread")
IDS = [4, 1, 2]  # the streams entering layers 4, 1, 2 (= the outputs of layers 3, 0, 1)


def dflash_head(stories_model):
    """A block head the DFlash formats take (q/k norms, reserved mask id 3), every weight perturbed."""
    torch.manual_seed(0)
    head = init_head_from_target(stories_model, "stories260K", "block", block_size=4, layer_ids=IDS, qk_norm=True,
                                 mask_token_id=3)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.05 * torch.randn_like(param))
    return head


@pytest.fixture(scope="module")
def head(stories_model):
    return dflash_head(stories_model)


def block_logits(head, features: torch.Tensor, pending: list[int] = (5, 9)) -> torch.Tensor:
    """The head's drafts [N, B-1, V] for each pending token after the T context positions of `features` [T, n, H]
    (the target layers in the head's id order)."""
    n, length, block = len(pending), features.shape[0], head.block_size
    context = [kv[None] for kv in head.context_kv(head.features(None, features), torch.arange(length))]
    positions = torch.arange(length, length + block)[None].expand(n, -1)
    return head(torch.tensor(pending), positions, [kv.expand(n, -1, -1, -1, -1) for kv in context],
                torch.ones(n, length, dtype=torch.bool))


def test_dflash_exports_conform_to_their_loaders_and_read_back_to_the_same_head(head, stories_model, tmp_path):
    hidden = stories_model.config.hidden_size
    features = torch.randn(6, len(IDS), hidden, generator=torch.Generator().manual_seed(1))
    for fmt in DFLASH_FORMATS:
        folder = export_head(head, fmt, tmp_path / fmt)
        assert all(check(folder, loader) == [] for loader in loaders(fmt)), [check(folder, l) for l in loaders(fmt)]
        tensors = load_file(str(folder / "model.safetensors"))
        blocks = head.fc.weight.detach().split(hidden, dim=1)  # the head's order: ids 4, 1, 2
        assert torch.equal(tensors["fc.weight"], torch.cat([blocks[1], blocks[2], blocks[0]], dim=1))  # 1, 2, 4
        assert "mask_embedding" not in tensors and "lm_head.weight" not in tensors
        loaded = load_export(folder, stories_model)
        assert loaded.config == head.config
        assert all(torch.equal(t, loaded.state_dict()[name]) for name, t in head.state_dict().items())
        assert torch.equal(block_logits(loaded, features), block_logits(head, features))
    config = json.loads((tmp_path / "dflash" / "config.json").read_text())
    assert config["aux_hidden_state_layer_ids"] == [1, 2, 4] and config["mask_token_id"] == 3  # vLLM: layer inputs
    assert config["transformer_layer_config"]["model_type"] == "qwen3" and config["block_size"] == 4
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    sglang = json.loads((tmp_path / "sglang-dflash" / "config.json").read_text())
    assert sglang["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 1, 3], "block_size": 4}  # outputs
    # controls: a folder without a k_norm fails every table; an unperturbed head drafts other logits
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(config))
    save_file({k: t for k, t in load_file(str(tmp_path / "dflash" / "model.safetensors")).items()
               if k != "layers.0.self_attn.k_norm.weight"}, str(broken / "model.safetensors"))
    assert all("lacks layers.0.self_attn.k_norm.weight" in " ".join(check(broken, l)) for l in loaders("dflash"))
    plain = init_head_from_target(stories_model, "stories260K", "block", block_size=4, layer_ids=IDS, qk_norm=True,
                                  mask_token_id=3)
    assert not torch.allclose(block_logits(plain, features), block_logits(head, features))
