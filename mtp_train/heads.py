"""Build the head to train from the config: infer's `MTPHead` itself, so the runtime serves the trained function.

Architectures (conf/head/*.yaml; each norm and the projection bias can still be overridden to measure them):
  mtp     h'_i = layer(W [enorm(Emb(t_{i+1})); hnorm(h_i)]), final_norm, then the target's lm_head
  eagle1  h'_i = layer(W [Emb(t_{i+1}); h_i] + b), no norms, as EAGLE-1
  eagle3  fc(three target layers), a layer reading [norm(Emb); norm(state)], final_norm, a draft vocabulary's
          lm_head rows (infer.models.eagle3_head); the vocabulary is chosen by the trainer (mtp_train.draft_vocab)
  block   fc + hidden_norm of target layers as context keys/values, a query block [token, mask x (B-1)] through
          head.num_layers layers, B-1 drafts a forward (infer.models.block_head; trained by mtp_train.block_unroll;
          from_target_last_layer starts every layer as the target's last one, random draws them)
The decoder layer is of the target's kind: a Llama layer, or for DeepSeek-V2 an MLA layer with a dense MLP (or
the target's MoE, head.mlp=moe; EAGLE-3: Llama targets only). head.hidden_state=post_norm feeds the head norm(h_i),
the target's final norm applied to the stored states (no new precompute), as the runtime does at serving.

Initialisation (`head.init`):
  eh_proj     [0 | I] (and a zero bias; EAGLE-3's fc: [0 | 0 | I], the high layer): the head starts by passing
              h_i through and ignoring the token. The
              token half still gets gradients at once (they are proportional to the embedding, not to W), and
              the starting head is exactly infer's `init_head_from_target` drafter: a real, weak guess, so the
              first losses are finite and meaningful instead of those of a random function. (With hnorm on, the
              layer sees h_i at unit RMS; its own input_layernorm makes the scale irrelevant to attention/MLP.)
  layer       from_target_last_layer: a copy of the target's last decoder layer, read by name from its
              safetensors (DeepSeek-V2: attention of the last layer, the dense MLP of the first dense layer,
              since the last layer is MoE; with head.mlp=moe the whole last layer, experts and router included);
              random: N(0, initializer_range) weights, zero biases, unit norms.
  final_norm  the target's final norm weight (from_target_last_layer), else ones; enorm/hnorm: ones.
  EAGLE-3     its q/k/v read the state half of the last layer's (the embedding half starts at zero), hidden_norm
              is that layer's input norm (Eagle3Head.load_target_layer); a trainable lm_head starts as the
              target's rows at the draft ids, once the vocabulary is set.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from data_tools.config import HeadConfig
from infer.models.deepseek_v2 import DeepseekV2ForCausalLM
from infer.models.llama import LlamaDecoderLayer
from infer.models.mtp_head import DraftHead, MTPHeadConfig, head_config_for, head_module, target_identity
from mtp_train.target import Target, TargetError, read_tensors

SWITCHES = ("enorm", "hnorm", "final_norm", "proj_bias", "layer_input_norm")


def head_config(config: PretrainedConfig, head_cfg: HeadConfig, identity: dict) -> MTPHeadConfig:
    """MTPHeadConfig for a target config and a conf/head entry (its switches as given, not the defaults).

    head.architecture and head.init were checked when the config was composed (data_tools.config.HeadConfig)."""
    eagle3, block = head_cfg.architecture == "eagle3", head_cfg.architecture == "block"
    layer_ids = list(head_cfg.layer_ids) if (eagle3 or block) and head_cfg.layer_ids is not None else None
    if block:
        return head_config_for(config, identity, "block", layer_ids=layer_ids,
                               intermediate_size=head_cfg.intermediate_size, block_size=head_cfg.block_size,
                               num_layers=head_cfg.num_layers, mask_token_id=head_cfg.mask_token_id,
                               qk_norm=bool(head_cfg.qk_norm), num_key_value_heads=head_cfg.num_key_value_heads,
                               anchor_input=bool(head_cfg.anchor_input))
    return head_config_for(config, identity, head_cfg.architecture, head_cfg.hidden_state, head_cfg.mlp,
                           layer_ids=layer_ids, intermediate_size=head_cfg.intermediate_size,
                           num_key_value_heads=head_cfg.num_key_value_heads,
                           draft_vocab_size=head_cfg.draft_vocab_size if eagle3 else None,
                           trainable_lm_head=bool(head_cfg.trainable_lm_head) if eagle3 else False,
                           norm_before_residual=bool(head_cfg.norm_before_residual) if eagle3 else False,
                           **{name: getattr(head_cfg, name) for name in SWITCHES})


def build_head(target: Target, head_cfg: HeadConfig, path: str, dtype: torch.dtype = torch.float32) -> DraftHead:
    """The trainable head, initialised as documented above and attached to the target's shared tensors."""
    identity = target_identity(target.name, target.config, target.shared_sha256, path)
    head = head_module(head_config(target.config, head_cfg, identity))
    init_head(head, target, head_cfg.init, path)
    return head.to(dtype).attach(target.shared)


# --- initialisation ----------------------------------------------------------------------------------------
def init_random(module: nn.Module, std: float) -> None:
    """N(0, std) weights (Linear layers and an MoE router's [experts, H] table, built uninitialised), zero biases,
    unit norms."""
    for sub in module.modules():
        if isinstance(sub, nn.Linear):
            nn.init.normal_(sub.weight, std=std)
            if sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif getattr(sub, "weight", None) is not None and sub.weight.dim() == 1:  # RMSNorm
            nn.init.ones_(sub.weight)
        elif getattr(sub, "weight", None) is not None:  # the router
            nn.init.normal_(sub.weight, std=std)


def layer_state_from_checkpoint(path: str, config: PretrainedConfig, names: list[str],
                                moe_mlp: bool = False) -> dict[str, torch.Tensor]:
    """The parameters `names` of an infer decoder layer from the target's checkpoint: its last layer (dense MLP:
    the first dense layer).

    Llama's checkpoint keeps q/k/v and gate/up apart; infer's layer fuses them (qkv_proj, gate_up_proj), so
    those are concatenated in that order, as infer's loader places them."""
    last = config.num_hidden_layers - 1
    if config.model_type == "llama":
        sources = {name: [f"model.layers.{last}.{n}" for n in _checkpoint_names(name)] for name in names}
    else:
        # DeepSeek-V2 layers before first_k_dense_replace are dense, the last one is MoE: a dense head MLP comes
        # from layer 0, an MoE one (head.mlp=moe) with the rest of the last layer
        mlp_source = last if moe_mlp else 0
        sources = {name: [f"model.layers.{mlp_source if name.startswith('mlp.') else last}.{name}"] for name in names}
    wanted = {key for keys in sources.values() for key in keys}
    if config.model_type != "llama":  # transformers-5 checkpoints fuse each MoE layer's experts: split as infer does
        wanted |= {f"model.layers.{last}.mlp.experts.{kind}" for kind in ("gate_up_proj", "down_proj")}
    tensors = read_tensors(Path(path), wanted, torch.float32)
    if config.model_type != "llama":
        tensors = {name: t for key, value in tensors.items()
                   for name, t in DeepseekV2ForCausalLM.checkpoint_renames(key, value, config)}
    missing = sorted(key for keys in sources.values() for key in keys if key not in tensors)
    if missing:
        raise TargetError(f"{path}: checkpoint lacks {', '.join(missing[:4])} for head.init=from_target_last_layer")
    return {name: torch.cat([tensors[key] for key in keys]) for name, keys in sources.items()}


def _checkpoint_names(name: str) -> list[str]:
    """A Llama layer parameter's checkpoint tensors, in row order (qkv_proj -> q, k, v; gate_up_proj -> gate, up)."""
    for fused, parts in (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj"))):
        if f".{fused}." in name:
            return [name.replace(fused, part) for part in parts]
    return [name]


def widen_mlp(layer: dict[str, torch.Tensor], width: int, std: float) -> dict[str, torch.Tensor]:
    """A target layer's dense MLP widened to `width` units, computing the same function: the new units' gate and up
    rows are drawn N(0, std) and their down_proj columns are zero (Net2Net's function-preserving widening, Chen et
    al. 2016), so the head starts as the target's layer and training grows into the new units (their down_proj
    columns get gradients at once). Fused (gate_up_proj, Llama) and separate (gate_proj, up_proj) layouts."""
    down = layer["mlp.down_proj.weight"]
    extra = width - down.shape[1]
    if extra < 0:
        raise TargetError(f"head.intermediate_size={width} is narrower than the target layer's MLP "
                          f"({down.shape[1]}): a narrower head starts from head.init=random")
    if extra == 0:
        return layer

    def grown(part: torch.Tensor) -> torch.Tensor:  # the new units' rows after the target's: weights drawn, biases 0
        rows = torch.randn(extra, *part.shape[1:], dtype=part.dtype) * std if part.dim() == 2 else part.new_zeros(extra)
        return torch.cat((part, rows))

    out = dict(layer)
    for name in ("gate_up_proj",) if "mlp.gate_up_proj.weight" in layer else ("gate_proj", "up_proj"):
        for key in (f"mlp.{name}.weight", f"mlp.{name}.bias"):
            if key in layer:  # gate_up_proj: gate's rows then up's, each grown
                out[key] = torch.cat([grown(part) for part in layer[key].chunk(2 if name == "gate_up_proj" else 1)])
    out["mlp.down_proj.weight"] = torch.cat((down, down.new_zeros(down.shape[0], extra)), dim=1)
    return out


def init_head(head: DraftHead, target: Target, init: str, path: str) -> None:
    head.init_identity_projection()
    width = head.config.decoder_config().intermediate_size
    std = float(getattr(target.config, "initializer_range", 0.02))
    with torch.no_grad():
        if init == "from_target_last_layer" and head.config.architecture == "block":
            with torch.device("meta"):
                names = [name for name, _ in LlamaDecoderLayer(head.config.decoder_config()).named_parameters()]
            head.load_target_layer(widen_mlp(layer_state_from_checkpoint(path, target.config, names), width, std))
            head.final_norm.weight.copy_(target.norm_weight)
        elif head.config.architecture == "block":
            for layer in head.layers:
                init_random(layer, std)
            head.final_norm.weight.fill_(1.0)
        elif init == "from_target_last_layer" and head.config.architecture == "eagle3":
            with torch.device("meta"):  # the names of a target layer, to read from the checkpoint
                names = [name for name, _ in LlamaDecoderLayer(head.config.decoder_config()).named_parameters()]
            head.load_target_layer(widen_mlp(layer_state_from_checkpoint(path, target.config, names), width, std))
            head.final_norm.weight.copy_(target.norm_weight)
        elif init == "from_target_last_layer":
            names = [name for name, _ in head.layer.named_parameters()]
            state = layer_state_from_checkpoint(path, target.config, names, moe_mlp=head.config.mlp == "moe")
            head.layer.load_state_dict(state if head.config.mlp == "moe" else widen_mlp(state, width, std))
            if head.config.final_norm:
                head.final_norm.weight.copy_(target.norm_weight)
        else:
            init_random(head.layer, std)
            if head.config.final_norm:
                head.final_norm.weight.fill_(1.0)
