"""Head export (mtp_train.export) on stories260K heads.

- Every format reads back (load_export) into a head computing the same logits as the original, for an MTP head
  (three norms) and an EAGLE-1-style head (no norms, biased projection), with every parameter perturbed so that a
  misplaced row (q/k/v or gate/up swapped, a wrong offset) changes the logits; and through the engine the reloaded
  head drafts exactly what the original does.
- Names mean what they say: exporting the untrained head (the target's last layer) gives, under the NextN and EAGLE
  names, exactly the target checkpoint's own model.layers.4.* tensors; eh_proj is [embedding | hidden] (the
  untrained projection passes the hidden half through).
- No embedding or lm_head tensor leaves; configs name the target and its hidden size; a target of another hidden
  size or with other shared tensors is refused naming the file; writes replace the folder atomically.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from infer.attention import PackedCausalAttention
from infer.cli import run_cli
from infer.engine import Engine, EngineConfig
from infer.models.llama import LlamaForCausalLM
from infer.models.mtp_head import HeadLoadError, MTPHead, MTPHeadConfig, init_head_from_target, read_head, save_head
from infer.sampling_params import SamplingParams
from mtp_train.export import ExportError, export_head, load_export, main

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAST_LAYER = 4  # stories260K has 5 layers; the untrained head copies the last


def perturbed_head(model, architecture: str) -> MTPHead:
    head = init_head_from_target(model, "stories260K", architecture)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return head


@pytest.fixture(scope="module")
def head_dirs(stories_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    dirs = {arch: save_head(perturbed_head(stories_model, arch), root / arch) for arch in ("mtp", "eagle1")}
    dirs["untrained"] = save_head(init_head_from_target(stories_model, "stories260K"), root / "untrained")
    return dirs


@pytest.fixture(scope="module")
def sequence(stories_model) -> tuple[torch.Tensor, torch.Tensor]:
    """30 token ids and the target's hidden states on them."""
    ids = torch.randint(3, 512, (30,), generator=torch.Generator().manual_seed(1))
    out = stories_model(ids, torch.arange(30), PackedCausalAttention([30]), [None] * 5)
    return ids, out.hidden_states


def head_logits(head: MTPHead, sequence) -> torch.Tensor:
    ids, hidden = sequence
    n = len(ids)
    return head(ids[1:], torch.arange(n - 1), PackedCausalAttention([n - 1]), [None], hidden_states=hidden[:-1]).logits


def tensor_names(folder: Path) -> list[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("architecture,fmt", [("mtp", "runtime"), ("mtp", "sglang-nextn"), ("mtp", "eagle"),
                                              ("eagle1", "runtime"), ("eagle1", "eagle")])
def test_export_reloads_to_the_same_logits(stories_model, head_dirs, sequence, tmp_path, architecture, fmt):
    from infer.models.mtp_head import load_head

    original = load_head(head_dirs[architecture], stories_model)
    out = export_head(head_dirs[architecture], fmt, tmp_path / fmt)
    reloaded = load_export(out, stories_model)
    assert reloaded.config == original.config
    diff = (head_logits(reloaded, sequence) - head_logits(original, sequence)).abs().max().item()
    assert diff < 1e-5


def test_reloaded_export_drafts_exactly_like_the_original_in_the_engine(stories_model, head_dirs, tmp_path):
    from infer.models.mtp_head import load_head

    out = export_head(head_dirs["mtp"], "sglang-nextn", tmp_path / "nextn")
    results = []
    for head in (load_head(head_dirs["mtp"], stories_model), load_export(out, stories_model)):
        engine = Engine(stories_model, config=EngineConfig(num_pages=64, num_draft_tokens=3))
        engine.attach_drafter("mtp", head)
        requests = engine.generate([[1, 300, 301, 302], [1, 400]], SamplingParams(max_new_tokens=20, ignore_eos=True))
        results.append(([r.output_ids for r in requests], engine.spec_stats.to_dict()))
    assert results[0][0] == results[1][0]
    assert results[0][1]["accepted_length_histogram"] == results[1][1]["accepted_length_histogram"]


@pytest.mark.parametrize("fmt", ["sglang-nextn", "eagle"])
def test_foreign_exports_hold_no_target_tensors(head_dirs, tmp_path, fmt):
    names = tensor_names(export_head(head_dirs["mtp"], fmt, tmp_path / fmt))
    assert not [n for n in names if "embed_tokens" in n or "lm_head" in n or "shared_head.head" in n]


def test_nextn_and_eagle_names_hold_the_checkpoints_own_tensors(stories_hf_dir, head_dirs, tmp_path):
    """The untrained head is the target's last layer: under HF names it must be exactly that layer's tensors."""
    checkpoint = load_file(str(stories_hf_dir / "model.safetensors"))
    layer_prefix = f"model.layers.{LAST_LAYER}."
    layer = {k.removeprefix(layer_prefix): v for k, v in checkpoint.items() if k.startswith(layer_prefix)}
    hidden = 64
    for fmt, prefix, proj, final in (("sglang-nextn", "model.layers.0.", "model.layers.0.eh_proj.weight",
                                      "model.layers.0.shared_head.norm.weight"),
                                     ("eagle", "layers.0.", "fc.weight", "norm.weight")):
        exported = load_file(str(export_head(head_dirs["untrained"], fmt, tmp_path / fmt) / "model.safetensors"))
        exported_layer = {k.removeprefix(prefix): v for k, v in exported.items()
                          if k.startswith(prefix) and k.removeprefix(prefix) in layer}
        assert sorted(exported_layer) == sorted(layer)  # q/k/v, o, gate/up/down, both layer norms
        for name, tensor in layer.items():
            assert torch.equal(exported_layer[name], tensor), (fmt, name)
        # Embedding first: the untrained projection ignores the token and passes the hidden state through.
        assert torch.equal(exported[proj][:, :hidden], torch.zeros(hidden, hidden))
        assert torch.equal(exported[proj][:, hidden:], torch.eye(hidden))
        assert torch.equal(exported[final], checkpoint["model.norm.weight"])


def test_nextn_config_names_the_target_and_the_shapes(head_dirs, tmp_path):
    config = json.loads((export_head(head_dirs["mtp"], "sglang-nextn", tmp_path / "n") / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV3ForCausalLMNextN"]
    assert config["num_hidden_layers"] == 1 and config["num_nextn_predict_layers"] == 1
    assert (config["hidden_size"], config["vocab_size"], config["intermediate_size"]) == (64, 512, 172)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 8)
    assert config["rope_theta"] == 10000.0 and config["rms_norm_eps"] == 1e-5
    assert config["decoder_type"] == "llama" and "Llama decoder layer" in config["export"]["layout"]
    assert config["target"]["name"] == "stories260K" and config["target"]["hidden_size"] == 64
    eagle = json.loads((export_head(head_dirs["eagle1"], "eagle", tmp_path / "e") / "config.json").read_text())
    assert eagle["target"]["hidden_size"] == 64 and eagle["hidden_size"] == 64
    assert eagle["export"]["deviations"] == [d for d in eagle["export"]["deviations"] if "input_layernorm" in d]


@pytest.mark.parametrize("fmt", ["runtime", "sglang-nextn", "eagle"])
def test_a_target_of_another_hidden_size_is_refused_naming_the_file(head_dirs, tmp_path, fmt):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    out = export_head(head_dirs["mtp"], fmt, tmp_path / fmt)
    with pytest.raises(HeadLoadError, match=rf"{out / 'config.json'}.*hidden size 64.*32"):
        load_export(out, other)


def test_a_target_with_other_shared_tensors_is_refused(stories_model, head_dirs, tmp_path):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    out = export_head(head_dirs["mtp"], "eagle", tmp_path / "e")
    with pytest.raises(HeadLoadError, match="trained against 'stories260K'"):
        load_export(out, other)


def test_formats_that_cannot_hold_the_head_are_refused(head_dirs, tmp_path, stories_model):
    with pytest.raises(ExportError, match="no enorm, no hnorm, no final_norm, a projection bias"):
        export_head(head_dirs["eagle1"], "sglang-nextn", tmp_path / "n")
    assert not (tmp_path / "n").exists()
    eagle3 = init_head_from_target(stories_model, "stories260K", "eagle3")
    for fmt in ("sglang-nextn", "eagle"):
        with pytest.raises(ExportError, match="EAGLE-3 head exports to the runtime format only"):
            export_head(eagle3, fmt, tmp_path / fmt)
    assert load_export(export_head(eagle3, "runtime", tmp_path / "r"), stories_model).config == eagle3.config


@pytest.mark.parametrize("missing", ["k_proj", "v_proj"])  # a hole in the rows, and rows short at the end
def test_a_missing_piece_of_a_fused_projection_is_named(stories_model, head_dirs, tmp_path, missing):
    out = export_head(head_dirs["mtp"], "eagle", tmp_path / "e")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors[f"layers.0.self_attn.{missing}.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(HeadLoadError, match=r"model\.safetensors: .*self_attn\.qkv_proj\.weight"):
        load_export(out, stories_model)


def test_cli_replaces_the_folder_atomically_and_fails_in_one_line(stories_hf_dir, head_dirs, tmp_path, capsys):
    out = tmp_path / "exports" / "nextn"
    for fmt, flags in (("eagle", []), ("sglang-nextn", ["--overwrite"])):  # the second replaces the first
        assert main(["--head", str(head_dirs["mtp"]), "--format", fmt, "--out", str(out),
                     "--target", str(stories_hf_dir), *flags]) == 0
    assert json.loads((out / "config.json").read_text())["export"]["format"] == "sglang-nextn"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["nextn"]  # no temp or old folder left
    capsys.readouterr()
    assert run_cli(lambda: main(["--head", str(tmp_path / "nope"), "--format", "eagle", "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err


def test_mla_head_exports_to_nextn_with_its_own_names(stories_model, tmp_path):
    """A DeepSeek-V2 (MLA, dense MLP) head: the NextN layout's native decoder; EAGLE's Llama layout refuses it."""
    decoder = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                   kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6,
                   max_position_embeddings=512, attention_bias=False, hidden_act="silu", rope_parameters=None)
    head = MTPHead(MTPHeadConfig(hidden_size=64, vocab_size=512, decoder=decoder, decoder_type="deepseek_v2",
                                 target={"name": "tiny-mla", "hidden_size": 64, "vocab_size": 512}))
    torch.nn.init.normal_(head.eh_proj.weight, generator=torch.Generator().manual_seed(0))
    out = export_head(head, "sglang-nextn", tmp_path / "nextn")
    names = tensor_names(out)
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.shared_head.norm.weight" in names
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["kv_lora_rank"] == 32
    reloaded = load_export(out, stories_model)
    for name, tensor in head.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    with pytest.raises(ExportError, match="Llama decoder layer"):
        export_head(head, "eagle", tmp_path / "eagle")


def test_export_never_replaces_what_it_did_not_write(head_dirs, tmp_path, capsys):
    """Into a non-empty folder only with --overwrite, and never into a folder holding anything but an export (the
    run folder, with its head and checkpoints, above all)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    head = save_head(read_head(head_dirs["mtp"]), run / "head")
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    out = tmp_path / "export"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    for target, flags in ((run, []), (run, ["--overwrite"]), (out, ["--overwrite"])):
        code = run_cli(lambda: main(["--head", str(head), "--format", "eagle", "--out", str(target), *flags]))
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and "did not write" in err, err
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    assert (out / "notes.txt").read_text() == "mine"

    export = tmp_path / "eagle"
    assert main(["--head", str(head), "--format", "eagle", "--out", str(export)]) == 0
    assert run_cli(lambda: main(["--head", str(head), "--format", "eagle", "--out", str(export)])) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert main(["--head", str(head), "--format", "eagle", "--out", str(export), "--overwrite"]) == 0
