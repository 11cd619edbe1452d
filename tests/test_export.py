"""Head export (mtp_train.export) on stories260K heads and a tiny DeepSeek-V2 target, checked against the engines'
loader table (mtp_train.engine_loaders); an EAGLE-3 head's round trips, names and refusals in its two formats:
tests/test_export_eagle3.py.

- Every format reads back (load_export) into a head computing the same logits as the original, with every
  parameter perturbed so that a misplaced row changes the logits; through the engine the reloaded head drafts
  exactly what the original does.
- A head goes only where the engine feeds it what it was trained on and builds its function: eagle takes post-norm,
  norm-free, unbiased Llama heads; sglang-nextn post-norm DeepSeek-V2 heads with the target's MoE; eagle3 and
  speculators EAGLE-3 heads (with the target's lm_head rows when shared); everything else is refused with the reason
  (MTP heads of Llama targets are told the runtime command that serves them).
- Each export matches, name by name and shape by shape, what every loader of its format reads (and a tampered one
  does not); every config carries the target's max_position_embeddings, rope settings and vocabulary size.
- Names mean what they say: the untrained EAGLE head under EAGLE names is the checkpoint's own model.layers.4.*;
  eh_proj is [embedding | hidden]; an EAGLE-3 head's fused projections split into the engines' q/k/v and gate/up,
  its fc blocks in layer order. No embedding leaves, nor an lm_head but EAGLE-3's; writes replace the folder
  atomically.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
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
from infer.loader import load_model
from infer.models.eagle3_head import Eagle3Head, init_eagle3_from_target
from infer.models.mtp_head import (
    HeadLoadError, MTPHead, head_config_for, head_module, init_head_from_target, read_head, save_head,
    shared_weights, target_digest, target_identity,
)
from infer.sampling_params import SamplingParams
from mtp_train.engine_loaders import LOADERS, check, engine_layer_ids, loaders
from mtp_train.export import ExportError, export_head, load_export, main
from mtp_train.heads import init_random

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LAST_LAYER = 4  # stories260K has 5 layers; the untrained head copies the last


def perturb(head: MTPHead, seed: int = 0) -> MTPHead:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in head.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return head


def eagle_head(model, perturbed: bool = True) -> MTPHead:
    """What the EAGLE loaders serve: eagle1 without the projection bias, reading post-norm states."""
    untrained = init_head_from_target(model, "stories260K", "eagle1")
    config = replace(untrained.config, proj_bias=False, hidden_state="post_norm")
    head = MTPHead(config)
    head.load_state_dict({k: v for k, v in untrained.state_dict().items() if k != "eh_proj.bias"})
    head.attach(shared_weights(model))
    return perturb(head) if perturbed else head


@pytest.fixture(scope="module")
def dsv2_dir(tmp_path_factory) -> Path:
    """A tiny DeepSeek-V2 target (MLA, 4 routed experts + 1 shared, the first layer dense) saved by transformers."""
    from transformers import DeepseekV2Config  # noqa: PLC0415
    from transformers import DeepseekV2ForCausalLM as HFDeepseekV2  # noqa: PLC0415

    torch.manual_seed(0)
    config = DeepseekV2Config(vocab_size=512, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                              num_hidden_layers=2, num_attention_heads=4, kv_lora_rank=16, q_lora_rank=None,
                              qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                              num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              max_position_embeddings=256, rope_theta=20000.0)
    out = tmp_path_factory.mktemp("dsv2")
    HFDeepseekV2(config).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dsv2_model(dsv2_dir):
    return load_model(dsv2_dir)


def dsv2_head(model, **changes) -> MTPHead:
    """The NextN-shaped head of the tiny DeepSeek target: MLA + the target's MoE, post-norm inputs (drawn first: the
    router is built uninitialised, and a NaN there never equals itself)."""
    identity = {"name": "tiny-dsv2", "hidden_size": 32, "vocab_size": 512}
    config = head_config_for(model.config, identity, "mtp", **{"hidden_state": "post_norm", "mlp": "moe", **changes})
    head = MTPHead(config)
    init_random(head, 0.02)
    return perturb(head, seed=1).attach(shared_weights(model))


@pytest.fixture(scope="module")
def head_dirs(stories_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("heads")
    return {"mtp": save_head(perturb(init_head_from_target(stories_model, "stories260K")), root / "mtp"),
            "eagle": save_head(eagle_head(stories_model), root / "eagle"),
            "eagle1": save_head(perturb(init_head_from_target(stories_model, "stories260K", "eagle1")), root / "e1"),
            "untrained": save_head(eagle_head(stories_model, perturbed=False), root / "untrained")}


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


@pytest.mark.parametrize("architecture,fmt", [("mtp", "runtime"), ("eagle", "eagle"), ("eagle", "runtime"),
                                              ("eagle1", "runtime")])
def test_export_reloads_to_the_same_logits(stories_model, head_dirs, sequence, tmp_path, architecture, fmt):
    from infer.models.mtp_head import load_head

    original = load_head(head_dirs[architecture], stories_model)
    out = export_head(head_dirs[architecture], fmt, tmp_path / fmt)
    reloaded = load_export(out, stories_model)
    assert reloaded.config == original.config
    diff = (head_logits(reloaded, sequence) - head_logits(original, sequence)).abs().max().item()
    assert diff < 1e-5


def test_deepseek_moe_head_reloads_from_nextn_to_the_same_tensors_and_logits(dsv2_model, tmp_path):
    head = dsv2_head(dsv2_model)
    out = export_head(head, "sglang-nextn", tmp_path / "nextn")
    names = tensor_names(out)
    assert "model.layers.0.mlp.experts.3.down_proj.weight" in names and "model.layers.0.mlp.gate.weight" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names
    reloaded = load_export(out, dsv2_model)
    for name, tensor in head.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(2))
    hidden = dsv2_model(ids, torch.arange(12), PackedCausalAttention([12]), [(None, None)] * 2).hidden_states
    logits = [h(ids[1:], torch.arange(11), PackedCausalAttention([11]), [(None, None)],
                hidden_states=h.features(hidden[:-1])).logits for h in (head, reloaded)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_reloaded_export_drafts_exactly_like_the_original_in_the_engine(stories_model, head_dirs, tmp_path):
    from infer.models.mtp_head import load_head

    out = export_head(head_dirs["eagle"], "eagle", tmp_path / "eagle")
    results = []
    for head in (load_head(head_dirs["eagle"], stories_model), load_export(out, stories_model)):
        engine = Engine(stories_model, config=EngineConfig(num_pages=64, num_draft_tokens=3))
        engine.attach_drafter("mtp", head)
        requests = engine.generate([[1, 300, 301, 302], [1, 400]], SamplingParams(max_new_tokens=20, ignore_eos=True))
        results.append(([r.output_ids for r in requests], engine.spec_stats.to_dict()))
    assert results[0][0] == results[1][0]
    assert results[0][1]["accepted_length_histogram"] == results[1][1]["accepted_length_histogram"]


def test_foreign_exports_hold_no_target_tensors(head_dirs, dsv2_model, tmp_path):
    for out in (export_head(head_dirs["eagle"], "eagle", tmp_path / "e"),
                export_head(dsv2_head(dsv2_model), "sglang-nextn", tmp_path / "n")):
        names = tensor_names(out)
        assert names and not [n for n in names if "embed_tokens" in n or "lm_head" in n or "shared_head.head" in n]


def test_eagle_names_hold_the_checkpoints_own_tensors(stories_hf_dir, head_dirs, tmp_path):
    """The untrained head is the target's last layer: under EAGLE names it must be exactly that layer's tensors."""
    checkpoint = load_file(str(stories_hf_dir / "model.safetensors"))
    layer_prefix = f"model.layers.{LAST_LAYER}."
    layer = {k.removeprefix(layer_prefix): v for k, v in checkpoint.items()
             if k.startswith(layer_prefix) and "input_layernorm" not in k}  # EAGLE's layer 0 has no input norm
    hidden = 64
    exported = load_file(str(export_head(head_dirs["untrained"], "eagle", tmp_path / "e") / "model.safetensors"))
    exported_layer = {k.removeprefix("layers.0."): v for k, v in exported.items() if k.startswith("layers.0.")}
    assert sorted(exported_layer) == sorted(layer)  # q/k/v, o, gate/up/down, the post-attention norm
    for name, tensor in layer.items():
        assert torch.equal(exported_layer[name], tensor), name
    # Embedding first: the untrained projection ignores the token and passes the hidden state through.
    assert torch.equal(exported["fc.weight"][:, :hidden], torch.zeros(hidden, hidden))
    assert torch.equal(exported["fc.weight"][:, hidden:], torch.eye(hidden))
    assert torch.equal(exported["fc.bias"], torch.zeros(hidden))
    assert sorted(exported) == sorted(["fc.weight", "fc.bias", *(f"layers.0.{n}" for n in layer)])


def test_eagle_config_names_the_target_the_shapes_and_both_engines_classes(head_dirs, tmp_path):
    config = json.loads((export_head(head_dirs["eagle"], "eagle", tmp_path / "e") / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle", "LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 1 and config["bias"] is True
    assert (config["hidden_size"], config["vocab_size"], config["intermediate_size"]) == (64, 512, 172)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 8)
    assert config["export"]["hidden_state"].endswith("after the final norm")
    assert config["export"]["served_by"] == ["sglang LlamaForCausalLMEagle", "vllm EagleLlamaForCausalLM"]
    assert config["target"]["name"] == "stories260K" and config["target"]["hidden_size"] == 64


def target_fields(config: dict, fmt: str) -> tuple:
    """(max_position_embeddings, rope theta, vocab size) where each format's loader reads them."""
    if fmt == "runtime":
        decoder = config["decoder"]
        return (decoder["max_position_embeddings"], (decoder.get("rope_parameters") or {}).get("rope_theta", 10000.0),
                config["vocab_size"])
    if fmt == "speculators":
        layer = config["transformer_layer_config"]
        return layer["max_position_embeddings"], layer["rope_theta"], layer["vocab_size"]
    return config["max_position_embeddings"], config["rope_theta"], config["vocab_size"]


def eagle3_head(model, layer_ids: tuple[int, ...] = (4, 1, 2), trainable_lm_head: bool = False,
                norm_before_residual: bool = False, num_key_value_heads: int | None = None) -> Eagle3Head:
    """A perturbed EAGLE-3 head on stories260K: a 128-id draft vocabulary (random target ids, so d2t is not a
    constant), aux layer ids out of order (the exports write them ascending), the target's lm_head rows shared or
    (trainable_lm_head) its own, its residual the fused state or (norm_before_residual) the normed one, the target's
    key/value heads or num_key_value_heads."""
    identity = target_identity("stories260K", model.config, target_digest(model))
    config = head_config_for(model.config, identity, "eagle3", layer_ids=list(layer_ids), draft_vocab_size=128,
                             trainable_lm_head=trainable_lm_head, norm_before_residual=norm_before_residual,
                             num_key_value_heads=num_key_value_heads)
    head = init_eagle3_from_target(head_module(config).attach(shared_weights(model)), model)
    head.set_draft_vocab(torch.randperm(512, generator=torch.Generator().manual_seed(4))[:128])
    head.share_lm_head_rows()
    return perturb(head, seed=2)


def write_all(head_dirs, dsv2_model, stories_model, root: Path) -> dict[str, Path]:
    """One folder per format: MTP / EAGLE-1 heads for the first three, an EAGLE-3 head for the last two."""
    eagle3 = eagle3_head(stories_model)
    return {"runtime": export_head(head_dirs["mtp"], "runtime", root / "runtime"),
            "eagle": export_head(head_dirs["eagle"], "eagle", root / "eagle"),
            "sglang-nextn": export_head(dsv2_head(dsv2_model), "sglang-nextn", root / "nextn"),
            "eagle3": export_head(eagle3, "eagle3", root / "eagle3"),
            "speculators": export_head(eagle3, "speculators", root / "spec")}


def test_every_export_conforms_to_the_loaders_that_serve_it(head_dirs, dsv2_model, stories_model, tmp_path):
    folders = write_all(head_dirs, dsv2_model, stories_model, tmp_path)
    served = {(l.fmt, l.engine): check(folders[l.fmt], l) for l in LOADERS}
    assert served == {**{key: [] for key in served}, ("sglang-nextn", "vllm"): served[("sglang-nextn", "vllm")]}
    # vLLM's DeepSeekMTP reads the MTP layer after the target's layers, with its own lm_head: not this layout
    vllm_nextn = " ".join(served[("sglang-nextn", "vllm")])
    assert "lacks model.layers.1.eh_proj.weight" in vllm_nextn and "shared_head.head.weight" in vllm_nextn
    # head ids (4, 1, 2) = the streams entering layers 4, 1, 2 = the outputs of layers 3, 0, 1, written ascending
    speculators = json.loads((folders["speculators"] / "config.json").read_text())
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # vLLM: the input of layer i
    eagle3 = json.loads((folders["eagle3"] / "config.json").read_text())
    assert eagle3["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]  # SGLang: layer i's output
    assert speculators["norm_before_residual"] is False and eagle3["norm_before_residual"] is False
    assert speculators["draft_vocab_size"] == eagle3["draft_vocab_size"] == 128
    assert engine_layer_ids([1, 2, 4], "vllm") == [2, 3, 5] and engine_layer_ids([1, 2, 4], "sglang") == [1, 2, 4]


def test_the_loader_check_finds_each_kind_of_mismatch(head_dirs, tmp_path):
    out = export_head(head_dirs["eagle"], "eagle", tmp_path / "e")
    [sglang] = [l for l in loaders("eagle") if l.engine == "sglang"]
    tensors = load_file(str(out / "model.safetensors"))
    tensors["layers.0.input_layernorm.weight"] = torch.ones(64)  # a tensor the loader does not build
    tensors["fc.weight"] = tensors["fc.weight"][:, :64].contiguous()  # a wrong shape
    del tensors["layers.0.mlp.up_proj.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    problems = check(out, sglang)
    assert any("input_layernorm.weight is not read" in p for p in problems)
    assert any("fc.weight is (64, 64), the loader builds (64, 128)" in p for p in problems)
    assert any("lacks layers.0.mlp.up_proj.weight" in p for p in problems)
    config = json.loads((out / "config.json").read_text())
    del config["num_key_value_heads"]
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    assert check(out, sglang) == ["sglang LlamaForCausalLMEagle: config.json num_hidden_layers=2, needs 1",
                                  "sglang LlamaForCausalLMEagle: config.json lacks 'num_key_value_heads'"]


def test_every_export_carries_the_targets_context_rope_and_vocabulary(head_dirs, dsv2_model, stories_model, tmp_path):
    folders = write_all(head_dirs, dsv2_model, stories_model, tmp_path)
    expected = {"runtime": (512, 10000.0, 512), "eagle": (512, 10000.0, 512), "sglang-nextn": (256, 20000.0, 512),
                "eagle3": (512, 10000.0, 512), "speculators": (512, 10000.0, 512)}
    for fmt, folder in folders.items():
        assert target_fields(json.loads((folder / "config.json").read_text()), fmt) == expected[fmt], fmt


@pytest.mark.parametrize("fmt", ["runtime", "eagle"])
def test_a_target_of_another_hidden_size_is_refused_naming_the_file(head_dirs, tmp_path, fmt):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    out = export_head(head_dirs["eagle"], fmt, tmp_path / fmt)
    with pytest.raises(HeadLoadError, match=rf"{out / 'config.json'}.*hidden size 64.*32"):
        load_export(out, other)


def test_a_target_with_other_shared_tensors_is_refused(stories_model, head_dirs, tmp_path):
    other = copy.deepcopy(stories_model)
    with torch.no_grad():
        other.model.embed_tokens.weight[0, 0] += 1.0
    out = export_head(head_dirs["eagle"], "eagle", tmp_path / "e")
    with pytest.raises(HeadLoadError, match="trained against 'stories260K'"):
        load_export(out, other)


@pytest.mark.parametrize("head,fmt,reasons", [
    ("mtp", "eagle", ["enorm, hnorm, final_norm, the decoder's input norm", "pre-norm inputs"]),
    ("eagle1", "eagle", ["a projection bias (vLLM builds fc without one", "pre-norm inputs"]),
    ("mtp", "sglang-nextn", ["no engine has an MTP path for Llama targets",
                             "python -m infer.generate --spec mtp --draft DIR"]),
    ("dsv2-dense", "sglang-nextn", ["a dense MLP (SGLang's NextN layer is MoE"]),
    ("dsv2-pre", "sglang-nextn", ["pre-norm inputs (SGLang feeds NextN"]),
    ("dsv2", "eagle", ["a 'deepseek_v2' decoder"]),
])
def test_heads_the_engines_would_serve_differently_are_refused_with_the_reason(head_dirs, dsv2_model, tmp_path, head,
                                                                              fmt, reasons):
    heads = {"dsv2": lambda: dsv2_head(dsv2_model), "dsv2-dense": lambda: dsv2_head(dsv2_model, mlp="dense"),
             "dsv2-pre": lambda: dsv2_head(dsv2_model, hidden_state="pre_norm")}
    source = heads[head]() if head in heads else head_dirs[head]
    with pytest.raises(ExportError) as err:
        export_head(source, fmt, tmp_path / "out")
    assert "\n" not in str(err.value) and all(reason in str(err.value) for reason in reasons), str(err.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("missing", ["k_proj", "v_proj"])  # a hole in the rows, and rows short at the end
def test_a_missing_piece_of_a_fused_projection_is_named(stories_model, head_dirs, tmp_path, missing):
    out = export_head(head_dirs["eagle"], "eagle", tmp_path / "e")
    tensors = load_file(str(out / "model.safetensors"))
    del tensors[f"layers.0.self_attn.{missing}.weight"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(HeadLoadError, match=r"model\.safetensors: .*self_attn\.qkv_proj\.weight"):
        load_export(out, stories_model)


def test_cli_replaces_the_folder_atomically_and_fails_in_one_line(stories_hf_dir, head_dirs, tmp_path, capsys):
    out = tmp_path / "exports" / "eagle"
    for fmt, flags in (("runtime", []), ("eagle", ["--overwrite"])):  # the second replaces the first
        assert main(["--head", str(head_dirs["eagle"]), "--format", fmt, "--out", str(out),
                     "--target", str(stories_hf_dir), *flags]) == 0
    assert json.loads((out / "config.json").read_text())["export"]["format"] == "eagle"
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in out.parent.iterdir()] == ["eagle"]  # no temp or old folder left
    capsys.readouterr()
    assert run_cli(lambda: main(["--head", str(tmp_path / "nope"), "--format", "eagle", "--out", str(out)])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err
    assert run_cli(lambda: main(["--head", str(head_dirs["mtp"]), "--format", "sglang-nextn", "--out",
                                 str(tmp_path / "n")])) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "infer.generate --spec mtp" in err


def test_help_names_each_format_with_its_engine_and_the_runtime_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for needle in ("runtime infer's head folder", "python -m infer.generate --model TARGET --spec mtp --draft DIR",
                   "no engine serves them", "SGLang LlamaForCausalLMEagle", "vLLM EagleLlamaForCausalLM",
                   "SGLang DeepseekV3ForCausalLMNextN", "SGLang LlamaForCausalLMEagle3", "vLLM's speculators format",
                   "speculators 0.9.0 package's Eagle3DraftModel", "needs --target", "docs/engine_loaders.md"):
        assert needle in text, needle


def test_export_never_replaces_what_it_did_not_write(head_dirs, tmp_path, capsys):
    """Into a non-empty folder only with --overwrite, and never into a folder holding anything but an export (the
    run folder, with its head and checkpoints, above all)."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_2")
    head = save_head(read_head(head_dirs["eagle"]), run / "head")
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
