"""The target, as far as head training needs it: its config and its frozen shared tensors, read by name.

Only `model.embed_tokens.weight`, `lm_head.weight` (absent when tied) and `model.norm.weight` are read from
the checkpoint's safetensors (`safe_open`, one tensor at a time); no decoder layer is loaded. The embedding and
lm_head are held once: with tied embeddings lm_head's weight *is* the embedding tensor. They are frozen and
wrapped in infer's `SharedTargetWeights`, which a head references without registering, so they are never in
the optimizer, in `head.parameters()` or in any checkpoint. The target's final norm (also frozen) turns stored
hidden states back into the target's next-token distribution, and into a post_norm head's input.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from data_tools.config import ModelConfig
from infer.loader import load_config, safetensors_files
from infer.models.common import RMSNorm
from infer.models.mtp_head import SharedTargetWeights, shared_tensors_sha256

EMBED_KEY, LM_HEAD_KEY, NORM_KEY = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"


class TargetError(ValueError):
    """A target that cannot be trained against; the message names the file or config field."""


def target_config(model_cfg: ModelConfig | DictConfig, need_weights: bool) -> PretrainedConfig:
    """The target's config: its folder's config.json when present, else the shapes written in conf/model/*.yaml."""
    path = Path(str(model_cfg.path)) if getattr(model_cfg, "path", None) else None
    if path is not None and (path / "config.json").is_file():
        return load_config(path)
    if need_weights:
        raise TargetError(f"model.path={path}: no config.json there; set model.path to the target's Hugging Face folder")
    fields = OmegaConf.to_container(model_cfg.config, resolve=True)
    return AutoConfig.for_model(fields.pop("model_type"), **fields)


def read_tensors(path: Path, names: set[str], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """The named tensors from a checkpoint folder (any shard layout), nothing else; dtype None keeps the stored one."""
    found: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in names.intersection(f.keys()):
                found[key] = f.get_tensor(key) if dtype is None else f.get_tensor(key).to(dtype)
    return found


@dataclass
class Target:
    name: str
    config: PretrainedConfig
    shared: SharedTargetWeights  # frozen embedding and lm_head (one tensor when tied)
    norm_weight: torch.Tensor  # frozen final RMSNorm weight [H]
    shared_sha256: str = ""  # infer's identity hash of the embedding and lm_head as stored in the checkpoint

    @property
    def eps(self) -> float:
        return float(self.config.rms_norm_eps)


def load_target(model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> Target:
    config = target_config(model_cfg, need_weights=True)
    path = Path(str(model_cfg.path))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    wanted = {EMBED_KEY, NORM_KEY} | (set() if tied else {LM_HEAD_KEY})
    tensors = read_tensors(path, wanted, None)
    missing = sorted(wanted - tensors.keys())
    if missing:
        raise TargetError(f"{path}: checkpoint lacks {', '.join(missing)}")
    vocab, hidden = config.vocab_size, config.hidden_size
    if tuple(tensors[EMBED_KEY].shape) != (vocab, hidden):
        raise TargetError(f"{path}: {EMBED_KEY} is {tuple(tensors[EMBED_KEY].shape)}, config.json says ({vocab}, {hidden})")
    # The identity is hashed from the stored values, so a head trained in bf16 on an fp32 checkpoint still
    # matches a runtime that loads that checkpoint in fp32.
    sha = shared_tensors_sha256(tensors[EMBED_KEY], tensors[EMBED_KEY if tied else LM_HEAD_KEY])
    tensors = {key: value.to(device=device, dtype=dtype) for key, value in tensors.items()}
    embed = nn.Embedding(vocab, hidden, device="meta")
    embed.weight = nn.Parameter(tensors[EMBED_KEY], requires_grad=False)
    lm_head = nn.Linear(hidden, vocab, bias=False, device="meta")
    lm_head.weight = embed.weight if tied else nn.Parameter(tensors[LM_HEAD_KEY], requires_grad=False)
    norm = RMSNorm(hidden, float(config.rms_norm_eps))  # frozen too: a post_norm head reads norm(h_i)
    norm.weight = nn.Parameter(tensors[NORM_KEY], requires_grad=False)
    return Target(str(model_cfg.name), config, SharedTargetWeights(embed, lm_head, norm), tensors[NORM_KEY], sha)
