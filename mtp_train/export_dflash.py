"""Block heads in the DFlash layouts (mtp_train.export's `dflash` and `sglang-dflash` formats), and back.

Both layouts hold the same tensors (what vLLM's qwen3_dflash, SGLang's dflash and speculators 0.9.0's DFlashDraftModel
read; mtp_train/engine_loaders.py DFLASH_LOADERS): fc.weight [H, n H] over the context layers in ascending order,
hidden_norm.weight, layers.{i}.* (Hugging Face split names, q_norm / k_norm), norm.weight; no embedding or lm_head
(the target's). They differ in config.json:

  dflash         speculators' (speculators_model_type dflash, transformer_layer_config a Qwen3 config, block_size,
                 aux_hidden_state_layer_ids in vLLM's convention: the stream entering layer i, mask_token_id): the
                 package loads it, vLLM serves it (its speculators `update_dflash` maps the ids to
                 dflash_config.target_layer_ids and eagle_aux_hidden_state_layer_ids)
  sglang-dflash  z-lab/dflash's (a Qwen3 config at the top, dflash_config {mask_token_id, target_layer_ids, block_size}
                 with ids as layer outputs): SGLang --speculative-algorithm DFLASH

A block head is written only where the engines compute its function: per-head q/k norms (head.qk_norm) and a reserved
mask token (head.mask_token_id); otherwise `dflash_problems` names what it lacks.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import torch

from infer.models.mtp_head import DraftHead, HeadLoadError, MTPHeadConfig
from mtp_train.engine_loaders import DFLASH_NEEDS
from mtp_train.export_names import aux_order, fuse_layer, split_fused

DFLASH_FORMATS = ("dflash", "sglang-dflash")
# the speculators configs' verifier: EAGLE-3 and block heads are built for Llama targets only
VERIFIER_ARCHITECTURES = ["LlamaForCausalLM"]


def dflash_problems(config: MTPHeadConfig) -> list[str]:
    """What the engines' DFlash drafters need that this block head lacks (DFLASH_NEEDS), one reason each."""
    return ([DFLASH_NEEDS["qk_norm"]] if not config.qk_norm else []) + \
        ([DFLASH_NEEDS["mask_token_id"]] if config.mask_token_id is None else []) + \
        ([DFLASH_NEEDS["anchor_input"]] if config.anchor_input else [])


def dflash_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    """A block head's state dict -> the DFlash tensors."""
    config = head.config
    state = {name: t.detach().contiguous().cpu() for name, t in head.state_dict().items()}
    order = aux_order(config)
    blocks = state.pop("fc.weight").chunk(len(order), dim=1)
    out = {"fc.weight": torch.cat([blocks[i] for i in order], dim=1),
           "hidden_norm.weight": state.pop("hidden_norm.weight"),
           "norm.weight": state.pop("final_norm.weight")}
    decoder = config.decoder_config()
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        layer = {k.removeprefix(prefix): state.pop(k) for k in list(state) if k.startswith(prefix)}
        out.update({prefix + name: t for name, t in split_fused(layer, decoder).items()})
    if state:
        raise HeadLoadError(f"{sorted(state)[0]!r} has no place in the DFlash layout")
    return out


def from_dflash(tensors: dict[str, torch.Tensor], config: MTPHeadConfig, source: Path) -> dict[str, torch.Tensor]:
    """Inverse of dflash_tensors: the head's state dict (its q/k/v stay split, gate/up fuse as infer's MLP)."""
    tensors = dict(tensors)
    missing = [name for name in ("fc.weight", "hidden_norm.weight", "norm.weight") if name not in tensors]
    if missing:
        raise HeadLoadError(f"{source}: {missing[0]} is missing from this DFlash export")
    order = aux_order(config)
    blocks = tensors.pop("fc.weight").chunk(len(order), dim=1)  # block j is the head's order[j]
    state = {"fc.weight": torch.cat([blocks[order.index(position)] for position in range(len(order))], dim=1),
             "hidden_norm.weight": tensors.pop("hidden_norm.weight"), "final_norm.weight": tensors.pop("norm.weight")}
    for i in range(config.num_layers):
        prefix = f"layers.{i}."
        layer = {k.removeprefix(prefix): tensors.pop(k) for k in list(tensors) if k.startswith(prefix)}
        mlp = {k: layer.pop(k) for k in list(layer) if k.startswith(("mlp.gate_proj.", "mlp.up_proj."))}
        state.update({prefix + name: t for name, t in {**layer, **fuse_layer(mlp, config, source)}.items()})
    if tensors:
        raise HeadLoadError(f"{source}: tensor {sorted(tensors)[0]!r} is not part of a DFlash head")
    return state


def dflash_config(config: MTPHeadConfig, fmt: str, decoder: dict, own: dict, verifier: str) -> dict:
    """config.json of a DFlash export. decoder: the head layers' Llama fields (mtp_train.export.decoder_fields), its
    layer count the head's; own: this project's fields (target, mtp_head, export)."""
    ids = [config.aux_layer_ids[i] for i in aux_order(config)]  # the stream entering layer i (vLLM's convention)
    layer = {**decoder, "model_type": "qwen3", "num_hidden_layers": config.num_layers, "attention_bias": False,
             "hidden_act": "silu", "tie_word_embeddings": False}
    if fmt == "dflash":
        return {"speculators_model_type": "dflash", "architectures": ["DFlashSpeculator"],
                "transformer_layer_config": layer, "draft_vocab_size": config.vocab_size,
                "block_size": config.block_size, "target_hidden_size": config.hidden_size,
                "aux_hidden_state_layer_ids": ids, "mask_token_id": config.mask_token_id,
                "sample_from_anchor": False,
                "speculators_config": {
                    "algorithm": "dflash", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": config.block_size - 1}],
                    "verifier": {"name_or_path": verifier, "architectures": VERIFIER_ARCHITECTURES}},
                **own}
    return {**layer, "architectures": ["DFlashDraftModel"], "block_size": config.block_size,
            "dflash_config": {"mask_token_id": config.mask_token_id, "target_layer_ids": [i - 1 for i in ids],
                              "block_size": config.block_size},
            **own}


def own_fields(config: MTPHeadConfig, fmt: str, source: str, target: dict, version: int, served_by: list[str]) -> dict:
    return {"target": target, "mtp_head": asdict(config),
            "export": {"format": fmt, "version": version, "source": source, "served_by": served_by,
                       "hidden_state": "the target's pre-norm residual stream entering each of aux_layer_ids",
                       "layout": "DFlash: fc, hidden_norm, layers.{i} (Qwen3: q_norm, k_norm), norm"}}
