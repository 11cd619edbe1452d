"""EAGLE-3 heads exported (mtp_train.export) to the runtime, eagle3 (SafeAILab / SGLang) and speculators (vLLM)
formats, on stories260K; the other formats and the loader table: tests/test_export.py.

- Each format reads back (load_export) into a head computing the same logits as the original, its aux layer ids out
  of order (the exports write them ascending, fc's blocks permuted to match), with the target's lm_head rows shared
  or its own, and more key/value heads than the target's.
- The engines' names hold the head's tensors: q/k/v and gate/up split from the fused projections, fc's blocks in
  layer order, the shared lm_head as the target's rows at the draft ids (d2t, t2d); no embedding.
- A head the formats cannot hold is refused with the reason (a shared lm_head without --target, another head, the
  target's last layer's output, norm_before_residual in SGLang's layout); a validation's recommended K travels with
  the export, and plain decoding where it is recommended is said on stderr. A reloaded export whose lm_head is not
  the target's rows is refused.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from infer.attention import PackedCausalAttention
from infer.models.eagle3_head import Eagle3Head
from infer.models.mtp_head import HeadLoadError, save_head
from mtp_train.engine_loaders import check, loaders
from mtp_train.export import ExportError, export_head, load_export, main
from tests.test_export import eagle3_head, head_dirs  # noqa: F401 - head_dirs: a fixture

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def eagle3_logits(head: Eagle3Head, model, ids: torch.Tensor) -> torch.Tensor:
    """Step-0 logits over the target's vocabulary: the head on the target's aux states at `ids`."""
    n = len(ids)
    out = model(ids, torch.arange(n), PackedCausalAttention([n]), [None] * 5, aux_layers=head.target_aux_layers)
    aux = torch.stack([out.aux_hidden_states[i] for i in head.target_aux_layers], dim=1)
    return head(ids[1:], torch.arange(n - 1), PackedCausalAttention([n - 1]), [None],
                hidden_states=head.features(out.hidden_states, aux)[:-1]).logits


@pytest.mark.parametrize("fmt", ["runtime", "eagle3", "speculators"])
@pytest.mark.parametrize("trainable_lm_head,kv_heads", [(False, None), (True, None), (False, 8)])
def test_an_eagle3_head_reloads_from_each_format_to_the_same_logits(stories_model, tmp_path, fmt, trainable_lm_head,
                                                                     kv_heads):
    """Its layer ids out of order: a reload that did not undo the export's fc permutation would change the logits.
    A head of more key/value heads than the target's (8 of 8 query heads) writes them where each engine reads the
    layer's shapes."""
    head = eagle3_head(stories_model, trainable_lm_head=trainable_lm_head, num_key_value_heads=kv_heads)
    folder = export_head(head, fmt, tmp_path / fmt)
    if kv_heads is not None and fmt != "runtime":
        config = json.loads((folder / "config.json").read_text())
        assert (config["transformer_layer_config"] if fmt == "speculators" else config)["num_key_value_heads"] == 8
        assert not [problem for loader in loaders(fmt) for problem in check(folder, loader)]
    reloaded = load_export(folder, stories_model)
    assert reloaded.config == head.config and reloaded.layer.self_attn.num_kv_heads == (kv_heads or 4)
    ids = torch.randint(3, 512, (20,), generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(eagle3_logits(reloaded, stories_model, ids), eagle3_logits(head, stories_model, ids),
                               rtol=0, atol=0)


@pytest.mark.parametrize("fmt,layer", [("eagle3", "midlayer"), ("speculators", "layers.0")])
def test_eagle3_exports_hold_the_heads_tensors_under_the_engines_names(stories_model, tmp_path, fmt, layer):
    head = eagle3_head(stories_model)
    tensors = load_file(str(export_head(head, fmt, tmp_path / fmt) / "model.safetensors"))
    state = head.state_dict()
    qkv, gate_up = state["layer.self_attn.qkv_proj.weight"], state["layer.mlp.gate_up_proj.weight"]
    assert qkv.shape == (128, 128)  # 8 query heads and 4 kv heads of 8, over [embedding ; state]
    for name, tensor in {"self_attn.q_proj": qkv[:64], "self_attn.k_proj": qkv[64:96], "self_attn.v_proj": qkv[96:],
                         "mlp.gate_proj": gate_up[:172], "mlp.up_proj": gate_up[172:]}.items():
        assert torch.equal(tensors[f"{layer}.{name}.weight"], tensor), name
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "self_attn.o_proj", "mlp.down_proj"):
        assert torch.equal(tensors[f"{layer}.{name}.weight"], state[f"layer.{name}.weight"]), name
    # head ids (4, 1, 2) -> fc's blocks for ids 1, 2, 4 (layer order, as the engines concatenate)
    fc = state["fc.weight"]
    assert torch.equal(tensors["fc.weight"], torch.cat([fc[:, 64:128], fc[:, 128:], fc[:, :64]], dim=1))
    assert torch.equal(tensors["norm.weight"], state["final_norm.weight"])
    # the shared lm_head: the target's rows at the draft ids (d2t[i] = target id - i, t2d marks those ids)
    draft_ids = torch.arange(128) + tensors["d2t"]
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert torch.equal(draft_ids, head.draft_token_ids()) and torch.equal(tensors["t2d"].nonzero()[:, 0], draft_ids)
    assert torch.equal(tensors["lm_head.weight"], stories_model.lm_head.weight[draft_ids])
    assert not [name for name in tensors if "embed" in name]


def test_eagle3_exports_refuse_what_they_cannot_hold(stories_model, stories_hf_dir, head_dirs, tmp_path, capsys):
    shared = save_head(eagle3_head(stories_model), tmp_path / "shared")
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(ExportError, match="scores the target's lm_head rows.*pass --target"):
            export_head(shared, fmt, tmp_path / fmt)  # read without its target: no rows to write
        with pytest.raises(ExportError, match="holds EAGLE-3 heads .*not this mtp head"):
            export_head(head_dirs["mtp"], fmt, tmp_path / fmt)
        assert not (tmp_path / fmt).exists()
    for fmt in ("eagle", "sglang-nextn"):
        with pytest.raises(ExportError, match="EAGLE-3 head exports to the runtime, eagle3 or speculators format"):
            export_head(shared, fmt, tmp_path / fmt)
    own = save_head(eagle3_head(stories_model, trainable_lm_head=True), tmp_path / "own")
    assert load_export(export_head(own, "eagle3", tmp_path / "own-eagle3"), stories_model).lm_head is not None
    assert main(["--head", str(shared), "--format", "speculators", "--out", str(tmp_path / "cli"),
                 "--target", str(stories_hf_dir)]) == 0
    assert "speculators, 15 tensors" in capsys.readouterr().out
    config = json.loads((tmp_path / "cli" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == str(stories_hf_dir)
    last = save_head(eagle3_head(stories_model, layer_ids=(1, 3, 5)), tmp_path / "last")  # 5: the last output
    for fmt in ("eagle3", "speculators"):
        with pytest.raises(ExportError, match="fuses id 5, the target's last layer's output.*runtime format"):
            export_head(last, fmt, tmp_path / f"last-{fmt}", target=stories_hf_dir)
    assert export_head(last, "runtime", tmp_path / "last-runtime", target=stories_hf_dir).is_dir()
    normed = save_head(eagle3_head(stories_model, norm_before_residual=True), tmp_path / "normed")
    with pytest.raises(ExportError, match="norm_before_residual.*SGLang.*speculators"):  # SGLang's layer has no flag
        export_head(normed, "eagle3", tmp_path / "normed-eagle3", target=stories_hf_dir)
    assert not (tmp_path / "normed-eagle3").exists()
    reloaded = load_export(export_head(normed, "speculators", tmp_path / "normed-spec", target=stories_hf_dir),
                           stories_model)
    assert reloaded.config.norm_before_residual and reloaded.layer.norm_before_residual
    report = tmp_path / "report.json"  # a validation's recommended K travels with the target's lm_head rows
    report.write_text(json.dumps({"recommended_k": {"by_batch_size": {"1": {"k": 3}}}}))
    for fmt in ("eagle3", "speculators"):
        out = export_head(shared, fmt, tmp_path / f"report-{fmt}", target=stories_hf_dir, report=report)
        assert load_export(out, stories_model).config.recommended_k == {"1": 3}
    capsys.readouterr()
    assert main(["--head", str(shared), "--format", "speculators", "--out", str(tmp_path / "cli-k3"),
                 "--target", str(stories_hf_dir), "--report", str(report)]) == 0
    assert "plain decoding" not in capsys.readouterr().err  # control: K=3 recommended, nothing to say
    report.write_text(json.dumps({"recommended_k": {"by_batch_size": {"1": {"k": 0}, "8": {"k": 0}}}}))
    assert main(["--head", str(shared), "--format", "speculators", "--out", str(tmp_path / "cli-k0"),
                 "--target", str(stories_hf_dir), "--report", str(report)]) == 0
    err = capsys.readouterr().err  # plain decoding wins everywhere: the written 3 is said to be the config's floor
    assert "recommends plain decoding (K=0) at batch size 1, 8" in err and "so it says 3" in err
    config = json.loads((tmp_path / "cli-k0" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert main(["--head", str(shared), "--format", "runtime", "--out", str(tmp_path / "cli-k0-runtime"),
                 "--target", str(stories_hf_dir), "--report", str(report)]) == 0
    assert "plain decoding" not in capsys.readouterr().err  # the runtime's config carries the 0: nothing to say


def test_a_reloaded_eagle3_export_whose_lm_head_is_not_the_targets_rows_is_refused(stories_model, tmp_path):
    out = export_head(eagle3_head(stories_model), "speculators", tmp_path / "spec")
    tensors = load_file(str(out / "model.safetensors"))
    tensors["lm_head.weight"][0, 0] += 1.0
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(HeadLoadError, match=r"lm_head\.weight is not the target's rows at the draft ids"):
        load_export(out, stories_model)
