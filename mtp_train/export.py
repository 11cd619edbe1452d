"""Export a head for another runtime, and read every export back into infer's MTPHead.

    python -m mtp_train.export --head DIR --format {runtime,sglang-nextn,eagle} --out DIR [--target DIR] [--overwrite]

Every format is a folder with config.json and model.safetensors, written atomically, holding no embedding or
lm_head tensor (those are the target's). Each config.json names the target and carries the head's MTPHeadConfig
("mtp_head"), so `load_export(dir, target)` rebuilds the same function and refuses a target it was not trained for.
  runtime       infer's head folder (`save_head`), what `Engine.load_drafter("mtp", DIR)` reads
  sglang-nextn  DeepSeek-V3's NextN (MTP) layout, all under model.layers.0 (heads with every norm, no bias)
  eagle         EAGLE-1/2's layout: fc + layers.0 (Llama decoders); deviations from EAGLE-1 listed in config.json
docs/export_formats.md has each layout's names, the concatenation order, and which hidden state each engine feeds.
--out must be a new or empty folder, or (with --overwrite) hold an earlier export and nothing else.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from infer.atomic_io import atomic_folder
from infer.cli import CliError, run_cli
from infer.loader import load_model
from infer.models.llama import fused_rows
from infer.models.mtp_head import (
    HEAD_FILES,
    DraftHead,
    HeadLoadError,
    MTPHead,
    MTPHeadConfig,
    attach_to_target,
    check_target,
    load_head,
    load_weights,
    read_head,
    save_head,
)

FORMATS = ("runtime", "sglang-nextn", "eagle")
EXPORT_VERSION = 1
HIDDEN_STATE = "target's last decoder layer output, before the final norm"
NEXTN_PREFIX = "model.layers.0"
# Our module -> its name in each format (the decoder layer's tensors also get HF split names).
MODULE_NAMES = {
    "sglang-nextn": {"enorm": f"{NEXTN_PREFIX}.enorm", "hnorm": f"{NEXTN_PREFIX}.hnorm",
                     "eh_proj": f"{NEXTN_PREFIX}.eh_proj", "final_norm": f"{NEXTN_PREFIX}.shared_head.norm",
                     "layer": NEXTN_PREFIX},
    "eagle": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "fc", "final_norm": "norm", "layer": "layers.0"},
}
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


class ExportError(ValueError):
    """A head that the requested format cannot represent; the message says why."""


# --- name and layout mapping ----------------------------------------------------------------------------------------
def split_layer(layer_state: dict[str, torch.Tensor], config: MTPHeadConfig) -> dict[str, torch.Tensor]:
    """infer's decoder-layer tensors -> Hugging Face names: qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj.

    The row ranges are infer's loader's own (`fused_rows`), so export and load are inverse by construction."""
    if config.decoder_type != "llama":
        return dict(layer_state)  # infer's MLA layer already uses the checkpoint's names
    decoder = config.decoder_config()
    out = {}
    for name, tensor in layer_state.items():
        module, param = name.rsplit(".", 1)
        if module not in FUSED:
            out[name] = tensor
            continue
        parent = module.rsplit(".", 1)[0]
        for part in FUSED[module]:
            key = f"{parent}.{part}.{param}"
            _, _, row, rows = fused_rows(key, None, decoder)
            out[key] = tensor[row : row + rows].clone()
    return out


def fuse_layer(hf_state: dict[str, torch.Tensor], config: MTPHeadConfig, source: Path) -> dict[str, torch.Tensor]:
    """Inverse of split_layer; a missing or misplaced piece is an error naming `source`."""
    if config.decoder_type != "llama":
        return dict(hf_state)
    decoder = config.decoder_config()
    out: dict[str, torch.Tensor] = {}
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, tensor in hf_state.items():
        placed = fused_rows(key, tensor, decoder)
        if len(placed) == 2:
            out[key] = tensor
        else:
            name, _, row, rows = placed
            if tensor.shape[0] != rows:
                raise HeadLoadError(f"{source}: {key} has {tensor.shape[0]} rows, the config implies {rows}")
            pieces.setdefault(name, []).append((row, tensor))
    for name, parts in pieces.items():
        parts.sort(key=lambda p: p[0])
        offset = 0
        for row, tensor in parts:
            if row != offset:
                raise HeadLoadError(f"{source}: the pieces of {name} do not cover its rows (a q/k/v or gate/up "
                                    "tensor is missing)")
            offset += tensor.shape[0]
        out[name] = torch.cat([t for _, t in parts])
    return out


def to_format(state: dict[str, torch.Tensor], config: MTPHeadConfig, fmt: str) -> dict[str, torch.Tensor]:
    """The head's state dict under `fmt`'s names."""
    names = MODULE_NAMES[fmt]
    layer = {name.removeprefix("layer."): t for name, t in state.items() if name.startswith("layer.")}
    out = {f"{names['layer']}.{name}": t for name, t in split_layer(layer, config).items()}
    for name, tensor in state.items():
        module, param = name.split(".", 1)
        if module != "layer":
            out[f"{names[module]}.{param}"] = tensor
    if fmt == "eagle" and "fc.bias" not in out:  # EAGLE loaders build fc with a bias: a zero one is the same function
        out["fc.bias"] = torch.zeros(config.hidden_size, dtype=out["fc.weight"].dtype)
    return out


def from_format(
    tensors: dict[str, torch.Tensor], config: MTPHeadConfig, fmt: str, source: Path
) -> dict[str, torch.Tensor]:
    """Inverse of to_format: `fmt`'s names back to MTPHead's state dict."""
    names = MODULE_NAMES[fmt]
    tensors = dict(tensors)
    if fmt == "eagle" and not config.proj_bias and "fc.bias" in tensors:
        bias = tensors.pop("fc.bias")
        if bool(bias.any()):
            raise HeadLoadError(f"{source}: fc.bias is non-zero but the head config has no projection bias")
    state, layer = {}, {}
    for key, tensor in tensors.items():
        module = next((m for m in ("enorm", "hnorm", "eh_proj", "final_norm") if key.startswith(names[m] + ".")), None)
        if module is not None:
            state[f"{module}.{key.removeprefix(names[module] + '.')}"] = tensor
        elif key.startswith(names["layer"] + "."):
            layer[key.removeprefix(names["layer"] + ".")] = tensor
        else:
            raise HeadLoadError(f"{source}: tensor {key!r} is not part of a {fmt} head")
    state.update({f"layer.{name}": t for name, t in fuse_layer(layer, config, source).items()})
    return state


# --- configs ----------------------------------------------------------------------------------------------------------
def decoder_fields(config: MTPHeadConfig) -> dict:
    """The decoder's shapes with rope settings both as rope_parameters and the older rope_theta / rope_scaling."""
    fields = {key: value for key, value in config.decoder.items() if key != "rope_parameters"}
    rope = config.decoder.get("rope_parameters") or {}
    fields["rope_theta"] = rope.get("rope_theta", 10000.0)
    fields["rope_scaling"] = rope if rope.get("rope_type", "default") != "default" else None
    fields["rope_parameters"] = rope or None
    return fields


def export_config(config: MTPHeadConfig, fmt: str, source: str, target_path: str | None) -> dict:
    target = {**config.target, **({"path": target_path} if target_path else {})}
    export = {"format": fmt, "version": EXPORT_VERSION, "source": source, "hidden_state": HIDDEN_STATE}
    common = {"hidden_size": config.hidden_size, "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
              "num_hidden_layers": 1, "target": target, "mtp_head": asdict(config), "export": export}
    if fmt == "sglang-nextn":
        llama = config.decoder_type == "llama"
        export["layout"] = (
            "DeepSeek NextN naming with a Llama decoder layer (split q/k/v, gate/up): SGLang's "
            "DeepseekV3ForCausalLMNextN builds an MLA + MoE layer and cannot load it as is" if llama
            else "DeepSeek NextN naming with a DeepSeek-V2 MLA decoder layer and a dense MLP")
        return {"architectures": ["DeepseekV3ForCausalLMNextN"], "model_type": "llama" if llama else "deepseek_v3",
                **decoder_fields(config), **common, "num_nextn_predict_layers": 1, "decoder_type": config.decoder_type,
                "tie_word_embeddings": False}
    deviations = []
    if config.layer_input_norm:
        deviations.append("layers.0.input_layernorm.weight: the decoder layer normalises its input "
                          "(EAGLE-1's first layer does not)")
    if config.enorm:
        deviations.append("enorm.weight: the embedding is RMS-normalised before fc (EAGLE-1 does not)")
    if config.hnorm:
        deviations.append("hnorm.weight: the hidden state is RMS-normalised before fc (EAGLE-1 does not)")
    if config.final_norm:
        deviations.append("norm.weight: a final norm before the target's lm_head (EAGLE-3's name; EAGLE-1 has none)")
    export["deviations"] = deviations
    export["layout"] = "EAGLE-1/2 (fc, layers.0), not EAGLE-3 (midlayer)"
    return {"architectures": ["LlamaForCausalLMEagle"], "model_type": "llama", **decoder_fields(config), **common,
            "bias": True, "tie_word_embeddings": False}


def check_exportable(config: MTPHeadConfig, fmt: str) -> None:
    if config.architecture == "eagle3" and fmt != "runtime":
        raise ExportError(f"an EAGLE-3 head exports to the runtime format only, not {fmt!r} (its keys are already "
                          "EAGLE-3's own: fc, layer.*, d2t, t2d, see infer/models/eagle3_head.py)")
    if fmt == "sglang-nextn":
        problems = [f"no {name}" for name in ("enorm", "hnorm", "final_norm") if not getattr(config, name)]
        problems += ["a projection bias"] if config.proj_bias else []
        problems += ["no decoder input norm"] if not config.layer_input_norm else []
        if problems:
            raise ExportError(f"this {config.architecture} head has {', '.join(problems)}: NextN always applies enorm, "
                              "hnorm and shared_head.norm and its eh_proj has no bias")
    if fmt == "eagle" and config.decoder_type != "llama":
        raise ExportError(f"the EAGLE layout holds a Llama decoder layer; this head's decoder is "
                          f"{config.decoder_type!r}")


# --- writing ---------------------------------------------------------------------------------------------------
def export_head(head: str | Path | DraftHead, fmt: str, out: str | Path, target: str | Path | None = None,
                overwrite: bool = False) -> Path:
    """Write `head` (a folder or an in-memory MTPHead) in format `fmt` to `out`.

    target: the target's folder; when given the head is checked against it (HeadLoadError on a mismatch) and its
    path is recorded in config.json. A non-empty `out` is replaced only with overwrite=True, and only when it holds
    an export's files alone (infer.atomic_io)."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS)}")
    out = Path(out)
    source = str(head) if not isinstance(head, DraftHead) else f"in-memory {head.config.architecture} head"
    if not isinstance(head, DraftHead):
        head = load_head(head, load_model(target)) if target is not None else read_head(head)
    elif target is not None:
        check_target(head.config, load_model(target), "the head")
    config = head.config
    check_exportable(config, fmt)
    if fmt == "runtime":
        return save_head(head, out, overwrite=overwrite)
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    tensors = {name: t.contiguous() for name, t in to_format(state, config, fmt).items()}
    with atomic_folder(out, owned=HEAD_FILES, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        config_json = export_config(config, fmt, source, str(target) if target is not None else None)
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    return out


# --- reading back ----------------------------------------------------------------------------------------------
def load_export(path: str | Path, target: nn.Module, dtype: torch.dtype | None = None) -> MTPHead:
    """Any export (or a runtime head folder) back into infer's MTPHead, attached to `target`'s embedding and lm_head."""
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
    if fmt not in MODULE_NAMES:
        raise HeadLoadError(f"{config_file}: unknown export format {fmt!r}")
    try:
        config = MTPHeadConfig(**raw["mtp_head"])
    except TypeError as err:
        raise HeadLoadError(f"{config_file}: 'mtp_head' is not a head config: {err}") from err
    check_target(config, target, str(config_file))
    head = MTPHead(config)
    load_weights(head, from_format(load_file(str(weights_file)), config, fmt, weights_file), weights_file)
    return attach_to_target(head, target, dtype, where=str(config_file))


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
    args = parser.parse_args(argv)
    if args.target is not None and not args.target.is_dir():
        raise CliError(f"--target {args.target} does not exist")
    if args.out.resolve() == args.head.resolve():
        raise CliError("--out must differ from --head")
    out = export_head(args.head, args.format, args.out, args.target, overwrite=args.overwrite)
    tensors = len(load_file(str(out / "model.safetensors")))
    print(f"wrote {out} ({args.format}, {tensors} tensors)")
    return 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
