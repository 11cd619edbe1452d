"""Export a head for vLLM or SGLang, and read every export back into the runtime's head.

    python -m mtp_train.export --head DIR --format FORMAT --out DIR [--target DIR] [--overwrite] [--report FILE]

Every format is a folder with config.json and model.safetensors, written atomically, holding no embedding (the
target's). Each config.json names the target, carries the head's MTPHeadConfig ("mtp_head") and the target's
max_position_embeddings, rope settings and vocab_size, so `load_export(dir, target)` rebuilds the same function and
refuses a target it was not trained for. A head is exported only where the engine feeds it the hidden state it was
trained on and builds the function it computes; otherwise ExportError says why.

  runtime       infer's head folder (`save_head`), any head; served here: python -m infer.generate --model TARGET
                --spec mtp --draft DIR (MTP, EAGLE-1 and EAGLE-3 heads). The only path for MTP heads of Llama
                targets: no engine serves them (SGLang's NextN builds DeepSeek layers, vLLM's MTP classes are per
                architecture).
  eagle         EAGLE-1/2 (fc + layers.0): SGLang LlamaForCausalLMEagle (--speculative-algorithm EAGLE) and vLLM
                EagleLlamaForCausalLM (method "eagle"). Heads with head.hidden_state=post_norm, no norms, no
                projection bias, Llama decoders (conf head=eagle1 with head.proj_bias=false).
  sglang-nextn  DeepSeek NextN (model.layers.0): SGLang DeepseekV3ForCausalLMNextN (--speculative-algorithm NEXTN).
                DeepSeek-V2 heads with head.mlp=moe and head.hidden_state=post_norm.
  eagle3        EAGLE-3 heads (head=eagle3), SafeAILab / SGLang layout (fc, midlayer, norm, lm_head, d2t, t2d):
                SGLang LlamaForCausalLMEagle3 (--speculative-algorithm EAGLE3); the speculators 0.9.0 converter
                reads it. Aux layer ids in SGLang's convention (this project's aux layers, layer outputs). Heads with
                head.norm_before_residual=false only: SGLang's layer adds the un-normed fused state.
  dflash        block heads in speculators' dflash layout: the speculators 0.9.0 package's DFlashDraftModel; vLLM
                (vllm serve TARGET --speculative-config '{"model": "DIR", ...}', method from speculators_model_type).
  sglang-dflash block heads in z-lab/dflash's layout (dflash_config): SGLang --speculative-algorithm DFLASH.
  Both DFlash formats take block heads with head.qk_norm=true (the engines' layers are Qwen3's: per-head q/k norms)
  and a reserved head.mask_token_id (the engines embed the mask rows as that token); others are refused, naming
  what they lack (mtp_train.export_dflash).
  speculators   EAGLE-3 heads in vLLM's speculators format (speculators_model_type eagle3, layers.0): vLLM
                (vllm serve TARGET --speculative-config '{"model": "DIR", ...}', versions with
                vllm/transformers_utils/configs/speculators) and the speculators 0.9.0 package's Eagle3DraftModel.
                Aux layer ids in vLLM's convention (the input of layer i).
  Both EAGLE-3 formats hold lm_head.weight [draft vocab, H]: a head sharing the target's lm_head needs --target,
  whose rows at the draft ids are written; the aux layers are written in ascending order (the engines concatenate
  the captured states in layer order), fc's column blocks permuted to match.
The versions and commits each rule was read from: docs/engine_loaders.md (mtp_train/engine_loaders.py checks
them); layouts and conventions: docs/export_formats.md.
--out must be a new or empty folder, or (with --overwrite) hold an earlier export and nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from infer.atomic_io import atomic_folder
from infer.cli import CliError, run_cli
from infer.loader import load_model
from infer.models.mtp_head import (
    HEAD_FILES,
    DraftHead,
    HeadLoadError,
    MTPHeadConfig,
    attach_to_target,
    check_target,
    copy_head,
    head_module,
    load_head,
    load_weights,
    read_head,
    read_head_config,
    save_head,
)
from mtp_train.engine_loaders import engine_layer_ids, loaders
from mtp_train.export_dflash import (DFLASH_FORMATS, VERIFIER_ARCHITECTURES, dflash_config, dflash_problems,
                                    dflash_tensors, from_dflash, own_fields)
from mtp_train.export_names import MODULE_NAMES, aux_order, from_format, fuse_layer, split_fused, to_format

FORMATS = ("runtime", "eagle", "sglang-nextn", "eagle3", "speculators", "dflash", "sglang-dflash")
EAGLE3_FORMATS = ("eagle3", "speculators")  # an EAGLE-3 head's, besides runtime
EXPORT_VERSION = 2
HIDDEN_STATES = {"pre_norm": "target's last decoder layer output, before the final norm",
                 "post_norm": "target's last decoder layer output, after the final norm"}
# An EAGLE-3 head's generic state dict (fc, layer.*, norm, lm_head, d2t, t2d; see eagle3_state) -> each layout's layer
EAGLE3_LAYER = {"eagle3": "midlayer", "speculators": "layers.0"}


class ExportError(ValueError):
    """A head that the requested format cannot represent or its engines would not serve as is; says why."""


# --- EAGLE-3 layout (the EAGLE-1/2 and NextN names: mtp_train.export_names) -----------------------------------------
def eagle3_state(head: DraftHead) -> tuple[dict[str, torch.Tensor], list[int]]:
    """An EAGLE-3 head -> (its generic state dict, the aux layers it reads as this project's layer outputs, ascending).

    fc's column blocks follow the ascending layers; final_norm is `norm`; lm_head.weight [draft vocab, H] is the
    head's own or, when it shares the target's, the target's rows at the draft ids (the engines read it from the
    folder): that needs the head attached to its target."""
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    order = aux_order(head.config)
    blocks = state.pop("fc.weight").chunk(len(order), dim=1)
    state["fc.weight"] = torch.cat([blocks[i] for i in order], dim=1)
    state["norm.weight"] = state.pop("final_norm.weight")
    if "lm_head.weight" not in state:
        if head.shared is None:
            raise ExportError("this EAGLE-3 head scores the target's lm_head rows, which the engines read from the "
                              "export's lm_head.weight: pass --target")
        state["lm_head.weight"] = head.lm_head_weight().detach().contiguous().cpu()
    return state, [head.config.aux_layer_ids[i] - 1 for i in order]


def from_eagle3(tensors: dict[str, torch.Tensor], config: MTPHeadConfig, fmt: str,
                source: Path) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Inverse of eagle3_tensors(eagle3_state(head)): (the head's state dict without a shared lm_head, lm_head.weight
    as written)."""
    prefix = EAGLE3_LAYER[fmt] + "."
    tensors = dict(tensors)
    missing = [name for name in ("fc.weight", "norm.weight", "lm_head.weight") if name not in tensors]
    if missing:
        raise HeadLoadError(f"{source}: {missing[0]} is missing from this {fmt} export")
    layer = {k.removeprefix(prefix): tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
    lm_head = tensors.pop("lm_head.weight")
    order = aux_order(config)
    blocks = tensors.pop("fc.weight").chunk(len(order), dim=1)  # ascending layers: block j is the head's order[j]
    fc = torch.cat([blocks[order.index(position)] for position in range(len(order))], dim=1)
    state = {"fc.weight": fc, "final_norm.weight": tensors.pop("norm.weight"),
             **{f"layer.{name}": t for name, t in fuse_layer(layer, config, source).items()}, **tensors}
    if config.trainable_lm_head:
        state["lm_head.weight"] = lm_head
    return state, lm_head


def eagle3_tensors(state: dict[str, torch.Tensor], decoder: PretrainedConfig, fmt: str) -> dict[str, torch.Tensor]:
    """A generic EAGLE-3 state dict (eagle3_state) -> the `fmt` layout ("eagle3" or "speculators").

    state: fc.weight [H, n_aux * H_target]; layer.* a Llama layer under infer's names (qkv_proj / gate_up_proj fused
    or split, q/k/v reading 2H) plus layer.hidden_norm.weight; norm.weight; lm_head.weight [draft_vocab, H],
    d2t [draft_vocab] (draft id -> target id - draft id) and t2d [vocab] (bool)."""
    layer = EAGLE3_LAYER[fmt]
    out = {}
    for name, tensor in split_fused({k.removeprefix("layer."): v for k, v in state.items()
                                     if k.startswith("layer.")}, decoder).items():
        out[f"{layer}.{name}"] = tensor
    unknown = sorted(k for k in state if not k.startswith("layer.") and k not in
                     ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"))
    if unknown:
        raise ExportError(f"{unknown[0]!r} is not part of an EAGLE-3 state dict (fc, layer.*, norm, lm_head, d2t, t2d)")
    return {**out, **{k: v for k, v in state.items() if not k.startswith("layer.")}}


# --- configs ----------------------------------------------------------------------------------------------------------
def decoder_fields(decoder: dict) -> dict:
    """The decoder's shapes with rope settings both as rope_parameters and the older rope_theta / rope_scaling
    (engines on transformers 4 read those), max_position_embeddings among them."""
    fields = {key: value for key, value in decoder.items() if key != "rope_parameters"}
    rope = decoder.get("rope_parameters") or {}
    fields["rope_theta"] = rope.get("rope_theta", 10000.0)
    fields["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    fields["rope_parameters"] = rope or None
    return fields


def export_config(config: MTPHeadConfig, fmt: str, source: str, target_path: str | None) -> dict:
    target = {**config.target, **({"path": target_path} if target_path else {})}
    export = {"format": fmt, "version": EXPORT_VERSION, "source": source,
              "hidden_state": HIDDEN_STATES[config.hidden_state],
              "served_by": [f"{loader.engine} {loader.cls}" for loader in loaders(fmt)]}
    common = {**decoder_fields(config.decoder), "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
              "rms_norm_eps": config.rms_norm_eps, "num_hidden_layers": 1, "tie_word_embeddings": False,
              "target": target, "mtp_head": asdict(config), "export": export}
    if fmt == "sglang-nextn":
        export["layout"] = "DeepSeek NextN: a DeepSeek-V2 MLA decoder layer with the target's MoE, as SGLang builds it"
        return {"architectures": ["DeepseekV3ForCausalLMNextN"], "model_type": "deepseek_v2", **common,
                "num_nextn_predict_layers": 1, "first_k_dense_replace": 0}
    export["layout"] = "EAGLE-1/2 (fc, layers.0 without its input norm), not EAGLE-3 (midlayer)"
    # SGLang takes the first architecture it knows; vLLM prefixes each with "Eagle" and takes EagleLlamaForCausalLM
    return {"architectures": ["LlamaForCausalLMEagle", "LlamaForCausalLM"], "model_type": "llama", **common,
            "bias": True}


def check_exportable(config: MTPHeadConfig, fmt: str, num_target_layers: int | None = None) -> None:
    """Refuse a head that the format's engines would serve as another function, or feed other inputs.
    num_target_layers (known when the target is given) rules out an EAGLE-3 id the engines cannot capture."""
    if fmt == "runtime":
        return
    if config.architecture == "block":
        if fmt not in DFLASH_FORMATS:
            raise ExportError(f"a block head exports to the runtime, dflash or sglang-dflash format, not {fmt!r}")
        if lacks := dflash_problems(config):
            raise ExportError(f"the {fmt} engines' DFlash drafters need {'; and '.join(lacks)}: serve it with the "
                              "runtime format")
        if num_target_layers is not None and max(config.aux_layer_ids) >= num_target_layers:
            raise ExportError(f"this block head fuses id {max(config.aux_layer_ids)}, the target's last layer's "
                              f"output: the engines capture only the streams entering layers 0.."
                              f"{num_target_layers - 1}; serve it with the runtime format")
        return
    if fmt in DFLASH_FORMATS:
        raise ExportError(f"the {fmt} format holds block heads (head=block), not this {config.architecture} head")
    if config.architecture == "eagle3":
        if fmt not in EAGLE3_FORMATS:
            raise ExportError(f"an EAGLE-3 head exports to the runtime, eagle3 or speculators format, not "
                              f"{fmt!r} (the engines' EAGLE-1/2 and NextN classes read one hidden state, not three "
                              "layers')")
        if num_target_layers is not None and max(config.aux_layer_ids) >= num_target_layers:
            raise ExportError(f"this EAGLE-3 head fuses id {max(config.aux_layer_ids)}, the target's last layer's "
                              f"output: vLLM and SGLang capture only the streams entering layers 0.."
                              f"{num_target_layers - 1}; serve it with the runtime format")
        if fmt == "eagle3" and config.norm_before_residual:
            raise ExportError("this EAGLE-3 head starts its residual stream from the normed fused state "
                              "(norm_before_residual): SGLang's LlamaForCausalLMEagle3 has no such flag and would add "
                              "the un-normed state; export it as speculators (vLLM) or runtime, or train it with "
                              "head.norm_before_residual=false for SGLang")
        return
    if fmt in EAGLE3_FORMATS:
        raise ExportError(f"the {fmt} format holds EAGLE-3 heads (head=eagle3: fc over three target layers, a "
                          f"2H-input layer), not this {config.architecture} head")
    post_norm = config.hidden_state == "post_norm"
    if fmt == "sglang-nextn":
        if config.decoder_type == "llama":
            raise ExportError("SGLang's NextN class builds a DeepSeek MLA + MoE layer and no engine has an MTP path for "
                              "Llama targets: serve this head here (python -m infer.generate --spec mtp --draft DIR, "
                              "format runtime)")
        problems = [f"no {name}" for name in ("enorm", "hnorm", "final_norm") if not getattr(config, name)]
        problems += ["a projection bias"] if config.proj_bias else []
        problems += ["no decoder input norm"] if not config.layer_input_norm else []
        problems += ["a dense MLP (SGLang's NextN layer is MoE: train with head.mlp=moe)"] if config.mlp != "moe" else []
        problems += ["pre-norm inputs (SGLang feeds NextN the target's state after its final norm: train with "
                     "head.hidden_state=post_norm)"] if not post_norm else []
        if problems:
            raise ExportError(f"this {config.architecture} head has {', '.join(problems)}: NextN applies enorm, hnorm "
                              "and shared_head.norm, has an unbiased eh_proj and an MoE layer fed post-norm states")
    if fmt == "eagle":
        problems = [f"a {config.decoder_type!r} decoder (the EAGLE layout holds a Llama layer)"] \
            if config.decoder_type != "llama" else []
        problems += [name for name in ("enorm", "hnorm", "final_norm") if getattr(config, name)]
        problems += ["the decoder's input norm"] if config.layer_input_norm else []
        problems += ["a projection bias (vLLM builds fc without one and drops fc.bias)"] if config.proj_bias else []
        problems += ["pre-norm inputs (both engines feed EAGLE drafters the target's state after its final norm: "
                     "train with head.hidden_state=post_norm)"] if not post_norm else []
        if problems:
            raise ExportError(f"this {config.architecture} head has {', '.join(problems)}: EAGLE-1/2 drafters in SGLang "
                              "and vLLM have no input, layer-0 or final norms and read post-norm states (conf "
                              "head=eagle1 head.proj_bias=false head.hidden_state=post_norm)")


def eagle3_export_config(config: MTPHeadConfig, fmt: str, aux_layers: list[int], source: str,
                         target_path: str | None) -> dict:
    """config.json of an EAGLE-3 export: SafeAILab / SGLang's (eagle3) or vLLM's speculators format. aux_layers are
    this project's (layer outputs), written in each reader's convention (engine_layer_ids); both record
    norm_before_residual (the head's: whether the residual starts from the normed fused state, infer.models.eagle3_head;
    always false in the eagle3 format, which refuses such a head) and the draft vocabulary's size."""
    target = {**config.target, **({"path": target_path} if target_path else {})}
    draft_vocab_size = config.draft_vocab_size or config.vocab_size
    decoder = {**decoder_fields(config.decoder), "num_hidden_layers": 1, "vocab_size": config.vocab_size,
               "tie_word_embeddings": False}
    own = {"target": target, "mtp_head": asdict(config),
           "export": {"format": fmt, "version": EXPORT_VERSION, "source": source, "aux_layers": list(aux_layers),
                      "hidden_state": "the target's pre-norm residual stream leaving each aux layer",
                      "served_by": [f"{loader.engine} {loader.cls}" for loader in loaders(fmt)]}}
    if fmt == "eagle3":
        ids = engine_layer_ids(aux_layers, "sglang")
        return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **decoder,
                "draft_vocab_size": draft_vocab_size, "target_hidden_size": config.hidden_size,
                "norm_before_residual": config.norm_before_residual, "bias": False,
                "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
                "eagle_aux_hidden_state_layer_ids": ids, **own}
    speculative_tokens = config.num_draft_tokens_for(1) or 3  # none recommended, or 0 (plain faster): speculators' 3
    return {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
            "transformer_layer_config": {"model_type": "llama", **decoder},
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
                "verifier": {"name_or_path": target.get("path") or target["name"],
                             "architectures": VERIFIER_ARCHITECTURES}},
            "draft_vocab_size": draft_vocab_size, "norm_before_residual": config.norm_before_residual,
            "target_hidden_size": config.hidden_size,
            "eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_layers, "vllm"), **own}


# --- writing ---------------------------------------------------------------------------------------------------
def recommended_k_from_report(report: Path) -> dict[str, int]:
    """batch size -> K from a validation report.json (mtp_train.validate's recommended_k)."""
    try:
        by_batch = json.loads(report.read_text())["recommended_k"]["by_batch_size"]
        return {str(int(batch)): int(entry["k"]) for batch, entry in by_batch.items()}
    except FileNotFoundError as err:
        raise ExportError(f"--report {report} does not exist") from err
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
        raise ExportError(f"{report} is not a validation report with a recommended K "
                          f"(python -m mtp_train.validate writes one): {err!r}") from err


def with_report(config: MTPHeadConfig, report: Path | None) -> MTPHeadConfig:
    """The head's config as exported: a validation report's recommended K per batch size replaces the head's own."""
    return config if report is None else replace(config, recommended_k=recommended_k_from_report(report))


def plain_decoding_note(config: MTPHeadConfig, fmt: str) -> str | None:
    """Where the validation recommends K=0 (no K predicted to beat plain decoding), vLLM or SGLang serving the export
    there decodes slower than the target alone, and neither engine's config can say so (the runtime format's can:
    infer.generate does not speculate there); speculators' needs one or more tokens and says 3 where batch 1's
    recommendation is 0."""
    plain = sorted(int(batch) for batch, k in (config.recommended_k or {}).items() if k == 0)
    if fmt == "runtime" or not plain:
        return None
    note = (f"note: the validation recommends plain decoding (K=0) at batch size {', '.join(map(str, plain))}: "
            "serving this head there is slower than serving the target alone")
    if fmt == "speculators" and config.num_draft_tokens_for(1) == 0:
        note += "; the speculators config needs one or more tokens, so it says 3"
    return note


def export_head(head: str | Path | DraftHead, fmt: str, out: str | Path, target: str | Path | None = None,
                overwrite: bool = False, report: Path | None = None) -> Path:
    """Write `head` (a folder or an in-memory head) in format `fmt` to `out`.

    target: the target's folder; when given the head is checked against it (HeadLoadError on a mismatch) and its
    path is recorded in config.json. A non-empty `out` is replaced only with overwrite=True, and only when it holds
    an export's files alone (infer.atomic_io)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out)
    source = str(head) if not isinstance(head, DraftHead) else f"in-memory {head.config.architecture} head"
    model = load_model(target) if target is not None else None
    if not isinstance(head, DraftHead):
        head = load_head(head, model) if model is not None else read_head(head)
    elif model is not None:
        check_target(head.config, model, "the head")
    if report is not None:  # the K to serve with, per batch size, travels with the head (the caller's is kept)
        head = copy_head(head)  # still attached: an EAGLE-3 export writes the target's lm_head rows
        head.config = with_report(head.config, report)
    config = head.config
    check_exportable(config, fmt, model.config.num_hidden_layers if model is not None else None)
    if fmt == "runtime":
        return save_head(head, out, overwrite=overwrite)
    target_path = str(target) if target is not None else None
    if fmt in DFLASH_FORMATS:
        target_info = {**config.target, **({"path": target_path} if target_path else {})}
        own = own_fields(config, fmt, source, target_info, EXPORT_VERSION,
                         [f"{loader.engine} {loader.cls}" for loader in loaders(fmt)])
        decoder = {**decoder_fields(config.decoder), "vocab_size": config.vocab_size}
        return write_folder(out, dflash_tensors(head), dflash_config(config, fmt, decoder, own, target_path or
                                                                     config.target["name"]), overwrite)
    if fmt in EAGLE3_FORMATS:
        state, aux_layers = eagle3_state(head)
        return write_folder(out, eagle3_tensors(state, config.decoder_config(), fmt),
                            eagle3_export_config(config, fmt, aux_layers, source, target_path), overwrite)
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    return write_folder(out, to_format(state, config, fmt), export_config(config, fmt, source, target_path),
                        overwrite)


def write_folder(out: str | Path, tensors: dict[str, torch.Tensor], config_json: dict, overwrite: bool = False) -> Path:
    """config.json + model.safetensors into `out`, atomically (infer.atomic_io: an earlier export alone is replaced)."""
    out = Path(out)
    with atomic_folder(out, owned=HEAD_FILES, overwrite=overwrite) as tmp:
        save_file({k: t.detach().contiguous().cpu() for k, t in tensors.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out


# --- reading back ----------------------------------------------------------------------------------------------
def load_export(path: str | Path, target: nn.Module, dtype: torch.dtype | None = None) -> DraftHead:
    """Any export (or a runtime head folder) back into infer's head, attached to `target`'s embedding and lm_head.
    An EAGLE-3 export's lm_head.weight must be the target's rows when the head shares them: the engines score it."""
    path = Path(path)
    config_file, weights_file = path / "config.json", path / "model.safetensors"
    for file in (config_file, weights_file):
        if not file.is_file():
            raise HeadLoadError(f"{file} is missing: expected an exported head folder "
                                "(config.json + model.safetensors)")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as err:
        raise HeadLoadError(f"{config_file} is not JSON: {err}") from err
    if "mtp_head" not in raw:  # infer's own head folder
        return load_head(path, target, dtype)
    fmt = raw.get("export", {}).get("format")
    if fmt not in MODULE_NAMES and fmt not in EAGLE3_FORMATS and fmt not in DFLASH_FORMATS:
        raise HeadLoadError(f"{config_file}: unknown export format {fmt!r}")
    try:
        config = MTPHeadConfig(**raw["mtp_head"])
    except TypeError as err:
        raise HeadLoadError(f"{config_file}: 'mtp_head' is not a head config: {err}") from err
    if (fmt in EAGLE3_FORMATS) != (config.architecture == "eagle3") or \
            (fmt in DFLASH_FORMATS) != (config.architecture == "block"):
        raise HeadLoadError(f"{config_file}: a {fmt} export cannot hold a {config.architecture} head")
    check_target(config, target, str(config_file))
    head = head_module(config)
    tensors = load_file(str(weights_file))
    if fmt in DFLASH_FORMATS:
        load_weights(head, from_dflash(tensors, config, weights_file), weights_file)
        return attach_to_target(head, target, dtype, where=str(config_file))
    if fmt not in EAGLE3_FORMATS:
        load_weights(head, from_format(tensors, config, fmt, weights_file), weights_file)
        return attach_to_target(head, target, dtype, where=str(config_file))
    state, lm_head = from_eagle3(tensors, config, fmt, weights_file)
    load_weights(head, state, weights_file)
    head = attach_to_target(head, target, dtype, where=str(config_file))
    if not config.trainable_lm_head and not torch.equal(lm_head, head.lm_head_weight().to(lm_head)):
        raise HeadLoadError(f"{weights_file}: lm_head.weight is not the target's rows at the draft ids, which this "
                            "head shares: the engines would score other logits")
    return head


# --- command line ---------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mtp_train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head", required=True, type=Path, help="the head folder (infer's format, as trained)")
    parser.add_argument("--format", required=True, choices=FORMATS, help="layout to write")
    parser.add_argument("--out", required=True, type=Path,
                        help="folder to write, atomically: new, empty, or an earlier export with --overwrite")
    parser.add_argument("--target", type=Path, help="the target's folder: check the head belongs to it")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an earlier export in --out (a folder holding anything else is refused)")
    parser.add_argument("--report", type=Path, help="a validation report.json: its recommended K per batch size "
                                                    "goes into the export's config (recommended_k)")
    args = parser.parse_args(argv)
    if args.target is not None and not args.target.is_dir():
        raise CliError(f"--target {args.target} does not exist")
    if args.out.resolve() == args.head.resolve():
        raise CliError("--out must differ from --head")
    out = export_head(args.head, args.format, args.out, args.target, overwrite=args.overwrite,
                      report=args.report)
    tensors = len(load_file(str(out / "model.safetensors")))
    print(f"wrote {out} ({args.format}, {tensors} tensors)")
    if (note := plain_decoding_note(with_report(read_head_config(args.head), args.report), args.format)) is not None:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
