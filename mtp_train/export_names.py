"""The EAGLE-1/2 and DeepSeek NextN formats' tensor names (mtp_train.export), and infer's fused Llama layer tensors
split into Hugging Face's names and back.

`to_format` / `from_format` map an MTPHead's state dict to a format's names and back; `split_fused` / `fuse_layer`
split a Llama layer's qkv_proj and gate_up_proj into q/k/v_proj and gate/up_proj with infer's loader's own row ranges
(`fused_rows`), so export and load are inverse by construction. Layouts: docs/export_formats.md.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PretrainedConfig

from infer.models.llama import fused_rows
from infer.models.mtp_head import HeadLoadError, MTPHeadConfig

NEXTN_PREFIX = "model.layers.0"
# Our module -> its name in each format (the decoder layer's tensors also get HF split names).
MODULE_NAMES = {
    "sglang-nextn": {"enorm": f"{NEXTN_PREFIX}.enorm", "hnorm": f"{NEXTN_PREFIX}.hnorm",
                     "eh_proj": f"{NEXTN_PREFIX}.eh_proj", "final_norm": f"{NEXTN_PREFIX}.shared_head.norm",
                     "layer": NEXTN_PREFIX},
    "eagle": {"eh_proj": "fc", "layer": "layers.0"},
}
FUSED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "mlp.gate_up_proj": ("gate_proj", "up_proj")}


def split_layer(layer_state: dict[str, torch.Tensor], config: MTPHeadConfig) -> dict[str, torch.Tensor]:
    """infer's decoder-layer tensors -> Hugging Face names (an MLA layer already uses the checkpoint's names)."""
    if config.decoder_type != "llama":
        return dict(layer_state)
    return split_fused(layer_state, config.decoder_config())


def split_fused(layer_state: dict[str, torch.Tensor], decoder: PretrainedConfig) -> dict[str, torch.Tensor]:
    """A Llama layer's qkv_proj -> q/k/v_proj, gate_up_proj -> gate/up_proj (split tensors pass through).

    The row ranges are infer's loader's own (`fused_rows`), so export and load are inverse by construction; the
    input width is whatever the layer has (EAGLE-3's q/k/v read 2H)."""
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


def aux_order(config: MTPHeadConfig) -> list[int]:
    """The positions of the head's aux layer ids in ascending order: the engines concatenate the captured states in
    layer order (vLLM's and SGLang's Llama forwards append them as the layers run), the head in its ids' order."""
    ids = config.aux_layer_ids
    return sorted(range(len(ids)), key=ids.__getitem__)


def to_format(state: dict[str, torch.Tensor], config: MTPHeadConfig, fmt: str) -> dict[str, torch.Tensor]:
    """The head's state dict under `fmt`'s names (check_exportable has ruled out modules a format lacks)."""
    names = MODULE_NAMES[fmt]
    layer = {name.removeprefix("layer."): t for name, t in state.items() if name.startswith("layer.")}
    out = {f"{names['layer']}.{name}": t for name, t in split_layer(layer, config).items()}
    for name, tensor in state.items():
        module, param = name.split(".", 1)
        if module != "layer":
            out[f"{names[module]}.{param}"] = tensor
    if fmt == "eagle":  # SGLang builds fc with a bias and loads whatever is there: a zero one is the same function
        out["fc.bias"] = torch.zeros(config.hidden_size, dtype=out["fc.weight"].dtype)
    return out


def from_format(
    tensors: dict[str, torch.Tensor], config: MTPHeadConfig, fmt: str, source: Path
) -> dict[str, torch.Tensor]:
    """Inverse of to_format: `fmt`'s names back to MTPHead's state dict."""
    names = MODULE_NAMES[fmt]
    tensors = dict(tensors)
    if fmt == "eagle" and "fc.bias" in tensors:
        if bool(tensors.pop("fc.bias").any()):
            raise HeadLoadError(f"{source}: fc.bias is non-zero, but vLLM drops it and the head has no bias")
    state, layer = {}, {}
    modules = [m for m in ("enorm", "hnorm", "eh_proj", "final_norm") if m in names]
    for key, tensor in tensors.items():
        module = next((m for m in modules if key.startswith(names[m] + ".")), None)
        if module is not None:
            state[f"{module}.{key.removeprefix(names[module] + '.')}"] = tensor
        elif key.startswith(names["layer"] + "."):
            layer[key.removeprefix(names["layer"] + ".")] = tensor
        else:
            raise HeadLoadError(f"{source}: tensor {key!r} is not part of a {fmt} head")
    state.update({f"layer.{name}": t for name, t in fuse_layer(layer, config, source).items()})
    return state
