"""The MTP draft head (DeepSeek-V3 style) as the runtime serves it, and the head folder format.

At position i the head reads the next token t_{i+1} and the target's hidden state h_i (its last layer's
output before the final norm, or after it for `hidden_state="post_norm"`: what vLLM and SGLang feed EAGLE-1/2
and NextN drafters) and predicts t_{i+2}:

    x_i  = eh_proj([enorm(Emb(t_{i+1})) ; hnorm(h_i)])       # concat, embedding first, then project 2H -> H
    h'_i = decoder_layer(x_i)                                  # one layer of the target's kind, own KV cache
    p    = softmax(lm_head(final_norm(h'_i)))

The decoder layer is a Llama layer, or for a DeepSeek-V2 target (`decoder_type="deepseek_v2"`) an MLA layer
with a dense MLP, or with the target's MoE (`mlp="moe"`: the layer SGLang's NextN and vLLM's DeepSeek MTP build);
its cache holds the compressed latent and the rope key, as the target's does.
Emb and lm_head are the target's own tensors, used in place (never copied, never saved with the head).
h'_i stands in for the target's h_{i+1} when the head drafts a second token. Each norm can be switched off
(EAGLE-1 has none and adds a bias to the projection) so their effect can be measured.

`DraftHead` is what every head architecture shares (the target's tensors, the one-layer KV cache, the hooks the
drafter and the trainer call); the EAGLE-3 head (`infer.models.eagle3_head`) is the other subclass.

A head folder holds `config.json` (`MTPHeadConfig` plus the decoder layer's config) and `model.safetensors`
with keys enorm.weight, hnorm.weight, eh_proj.weight (+ .bias), layer.*, final_norm.weight (EAGLE-3: its own keys,
see its module). This module is the one home of that format for every architecture: `read_head` (no target
needed), `attach_to_target`, `load_head` (both), `save_head`, and the builders `head_config_for` and
`init_head_from_target`.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import PretrainedConfig

from infer.atomic_io import atomic_folder
from infer.attention import AttentionBackend, cast
from infer.loader import serve_lean
from infer.models.common import ModelOutput, RMSNorm, RotaryEmbedding
from infer.models.deepseek_v2 import DeepseekV2DecoderLayer
from infer.models.block_head import BlockHead, block_config_fields, init_block_from_target
from infer.models.eagle3_head import Eagle3Head, eagle3_config_fields, init_eagle3_from_target
from infer.models.head_base import (
    HEAD_FORMAT_VERSION, DraftHead, HeadLoadError, MTPHeadConfig, SharedTargetWeights,
)
from infer.models.llama import LlamaDecoderLayer
from infer.parallel import whole_weight

ARCHITECTURES = ("mtp", "eagle1", "eagle3", "block")
DRAFTER_KINDS = {"mtp": "mtp", "eagle1": "mtp", "eagle3": "eagle3", "block": "block"}  # architecture -> infer.engine drafter kind
# The DeepSeek-V2 fields only an MoE MLP reads (head.mlp=moe); a dense layer ignores them.
MOE_DECODER_KEYS = ("moe_intermediate_size", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
                    "topk_method", "n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "scoring_func",
                    "moe_layer_freq")
# The target config fields a head's decoder layer copies, per decoder type.
DECODER_KEYS = {
    "llama": ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings", "attention_bias", "mlp_bias", "hidden_act"),
    "deepseek_v2": ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "q_lora_rank",
                    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rms_norm_eps",
                    "max_position_embeddings", "attention_bias", "hidden_act", *MOE_DECODER_KEYS),
}


class MTPHead(DraftHead):
    def __init__(self, config: MTPHeadConfig) -> None:
        super().__init__(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps) if config.enorm else nn.Identity()
        self.hnorm = RMSNorm(hidden, eps) if config.hnorm else nn.Identity()
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=config.proj_bias)
        decoder_config = config.decoder_config()
        self.mla = config.decoder_type == "deepseek_v2"
        if self.mla:
            self.layer = DeepseekV2DecoderLayer(decoder_config, layer_idx=0)
            rope_dim = decoder_config.qk_rope_head_dim
        else:
            self.layer = LlamaDecoderLayer(decoder_config)
            rope_dim = decoder_config.head_dim or decoder_config.hidden_size // decoder_config.num_attention_heads
        if not config.layer_input_norm:
            self.layer.input_layernorm = nn.Identity()
        self.final_norm = RMSNorm(hidden, eps) if config.final_norm else nn.Identity()
        self.rotary_emb = RotaryEmbedding(decoder_config, rope_dim)

    def init_identity_projection(self) -> None:
        """eh_proj = [0 | I] (and a zero bias): the head starts by passing h_i through and ignoring the token."""
        hidden = self.config.hidden_size
        with torch.no_grad():
            self.eh_proj.weight.zero_()
            self.eh_proj.weight[:, hidden:] = torch.eye(hidden)
            if self.eh_proj.bias is not None:
                self.eh_proj.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids [T] are t_{i+1}, hidden_states [T, H] are h_i, positions [T] are i; the outputs as
        `DraftHead.output` gives them."""
        assert self.shared is not None, "attach() the target's weights first"
        assert hidden_states is not None, "the head needs the target's hidden states"
        dtype = self.eh_proj.weight.dtype  # the head may run in another precision than the target
        emb = self.enorm(cast(self.shared.embed_tokens(input_ids), dtype))
        x = self.eh_proj(torch.cat((emb, self.hnorm(cast(hidden_states, dtype))), dim=-1))
        # Llama rotates half-split pairs, DeepSeek interleaved ones
        cos, sin = self.rotary_emb(positions) if self.mla else self.rotary_emb.tables(positions, x)
        x = self.layer(x, cos, sin, attn, kv_caches[0])
        return self.output(x, attn, logits_indices)


def config_identity(config: dict) -> dict:
    """A head config's fields (asdict, or as an older version wrote them) reduced to what decides the head's function,
    for comparing runs: a field an older version did not write holds its default (each field was added with the
    default that keeps the earlier behaviour), and a dense MLP's decoder drops the MoE fields it never reads (written
    since head.mlp exists), so a run saved before them matches a run that keeps those defaults."""
    defaults = {f.name: f.default if f.default is not MISSING else f.default_factory()
                for f in fields(MTPHeadConfig) if f.default is not MISSING or f.default_factory is not MISSING}
    identity = {**defaults, **config}
    if identity["mlp"] == "dense" and isinstance(identity.get("decoder"), dict):
        identity["decoder"] = {k: v for k, v in identity["decoder"].items() if k not in MOE_DECODER_KEYS}
    return identity


def head_module(config: MTPHeadConfig) -> DraftHead:
    """An unattached head of `config`'s architecture, weights uninitialised."""
    return {"eagle3": Eagle3Head, "block": BlockHead}.get(config.architecture, MTPHead)(config)


def shared_tensors_sha256(embed: torch.Tensor, lm_head: torch.Tensor, rows: int = 4096) -> str:
    """Identity of the target's shared tensors: a head trained against one target refuses another.

    Hashed as bfloat16, so a target served in bf16 and the fp32 checkpoint it came from agree; a block of
    rows at a time, so a 128k-row table never gets a full copy.
    """
    digest = hashlib.sha256()
    for tensor in (embed, lm_head):
        for block in tensor.detach().split(rows):
            digest.update(block.to(torch.bfloat16).view(torch.int16).cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


# Each target module's digest, computed once (hashing a 128k x 8k table takes seconds; validation loads heads often).
_DIGESTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def target_digest(target: nn.Module) -> str:
    if target not in _DIGESTS:
        # whole_weight: under tensor parallelism the ranks gather the vocabulary shards first
        _DIGESTS[target] = shared_tensors_sha256(whole_weight(target.model.embed_tokens), whole_weight(target.lm_head))
    return _DIGESTS[target]


def target_identity(name: str, config: PretrainedConfig, shared_sha256: str, path: str | None = None) -> dict:
    """What a head records of its target (MTPHeadConfig.target) and checks when it is loaded against one."""
    identity = {"name": name, "hidden_size": config.hidden_size, "vocab_size": config.vocab_size,
                "shared_tensors_sha256": shared_sha256}
    return {**identity, "path": path} if path is not None else identity


def check_target(config: MTPHeadConfig, target: nn.Module, where: str) -> None:
    """Refuse a head made for another target: hidden size and vocabulary, then the shared tensors' digest."""
    if (config.hidden_size, config.vocab_size) != (target.config.hidden_size, target.config.vocab_size):
        raise HeadLoadError(
            f"{where}: head is for {config.target.get('name')!r} with hidden size {config.hidden_size} / vocab "
            f"{config.vocab_size}, the target has hidden size {target.config.hidden_size} / vocab "
            f"{target.config.vocab_size}"
        )
    expected = config.target.get("shared_tensors_sha256")
    if expected and expected != target_digest(target):
        raise HeadLoadError(f"{where}: head was trained against {config.target.get('name')!r}, whose embedding/lm_head "
                            "differ from this target's")


# --- building a head for a target ------------------------------------------------------------------------------
def head_config_for(target_config: PretrainedConfig, identity: dict, architecture: str = "mtp",
                    hidden_state: str = "pre_norm", mlp: str = "dense", layer_ids: list[int] | None = None,
                    draft_vocab_size: int | None = None, trainable_lm_head: bool = False,
                    norm_before_residual: bool = False, intermediate_size: int | None = None,
                    num_key_value_heads: int | None = None, block_size: int = 8, num_layers: int = 1,
                    mask_token_id: int | None = None, qk_norm: bool = False, anchor_input: bool = False,
                    **switches: bool) -> MTPHeadConfig:
    """A head whose decoder layer is shaped like one of the target's layers.

    The norm and bias switches (enorm, hnorm, final_norm, proj_bias, layer_input_norm) default to the
    architecture's: mtp has every norm and an unbiased projection, eagle1 no norm and a biased one. hidden_state and
    mlp: MTPHeadConfig's (checked when the decoder config is built). eagle3 has its own layout
    (infer.models.eagle3_head): the switches do not apply; layer_ids (None: the default rule), draft_vocab_size
    (None: the whole vocabulary), trainable_lm_head and norm_before_residual do. intermediate_size: the layer's dense
    MLP width (None: the target's; on a small target a wider head MLP costs little and drafts better,
    docs/benchmark_history.md "Recipes"). num_key_value_heads: an EAGLE-3 or block layer's key/value heads (None: the
    target's; more widen the only path by which its token reaches the residual stream, same section). block (infer.models.
    block_head): layer_ids as EAGLE-3's, block_size (rows of the query block), num_layers, mask_token_id (the
    reserved id the mask rows embed as; None: a learned mask embedding), qk_norm (per-head q/k norms) and
    anchor_input (the mask rows also read the last context feature and the pending token).
    """
    kind = target_config.model_type
    if kind not in DECODER_KEYS:
        raise HeadLoadError(f"no head decoder for model_type {kind!r} ({', '.join(DECODER_KEYS)})")
    if architecture not in ARCHITECTURES:
        raise HeadLoadError(f"unknown head architecture {architecture!r}: choose one of {', '.join(ARCHITECTURES)}")
    decoder = {key: getattr(target_config, key) for key in DECODER_KEYS[kind]
               if getattr(target_config, key, None) is not None}
    if kind == "deepseek_v2":
        decoder["q_lora_rank"] = target_config.q_lora_rank  # None (V2-Lite) is meaningful: a plain q_proj
    rope = getattr(target_config, "rope_parameters", None)
    decoder["rope_parameters"] = dict(rope) if rope else None
    if intermediate_size is not None:
        if mlp == "moe":
            raise HeadLoadError("intermediate_size sets a dense MLP's width; an MoE head keeps the target's experts")
        decoder["intermediate_size"] = intermediate_size
    norms = architecture == "mtp"
    defaults = dict(enorm=norms, hnorm=norms, final_norm=norms, proj_bias=not norms, layer_input_norm=norms)
    unknown = sorted(set(switches) - set(defaults))
    if unknown:
        raise HeadLoadError(f"unknown head switch {unknown[0]!r}: choose from {', '.join(defaults)}")
    fields = {**defaults, **switches}
    if num_key_value_heads is not None:
        heads = decoder["num_attention_heads"]
        if architecture not in ("eagle3", "block") or kind != "llama":
            raise HeadLoadError(f"num_key_value_heads sets an EAGLE-3 or block layer's key/value heads, not "
                                f"{architecture}'s")
        if heads % num_key_value_heads or num_key_value_heads % decoder["num_key_value_heads"]:
            raise HeadLoadError(f"num_key_value_heads={num_key_value_heads} must divide the {heads} attention heads "
                                f"and be a multiple of the target's {decoder['num_key_value_heads']}")
        decoder["num_key_value_heads"] = num_key_value_heads
    if architecture == "block":
        if draft_vocab_size is not None or trainable_lm_head or norm_before_residual:
            raise HeadLoadError("a draft vocabulary, a trainable lm_head and norm_before_residual are EAGLE-3 options, "
                                "not block's")
        fields = block_config_fields(target_config, layer_ids, block_size, num_layers, mask_token_id, qk_norm,
                                     anchor_input)
    elif mask_token_id is not None or qk_norm or anchor_input:
        raise HeadLoadError(f"mask_token_id, qk_norm and anchor_input are block head options, not {architecture}'s")
    elif architecture == "eagle3":
        fields = eagle3_config_fields(target_config, layer_ids, draft_vocab_size, trainable_lm_head,
                                      norm_before_residual)
    elif draft_vocab_size is not None or trainable_lm_head or norm_before_residual:
        raise HeadLoadError("a draft vocabulary, a trainable lm_head and norm_before_residual are EAGLE-3 options, "
                            f"not {architecture}'s")
    config = MTPHeadConfig(
        hidden_size=target_config.hidden_size, vocab_size=target_config.vocab_size, decoder=decoder,
        rms_norm_eps=float(target_config.rms_norm_eps), architecture=architecture, target=identity,
        decoder_type=kind, hidden_state=hidden_state, mlp=mlp, **fields,
    )
    config.decoder_config()  # an unknown hidden_state or mlp is refused here, naming the field
    return config


def init_head_from_target(target: nn.Module, target_name: str, architecture: str = "mtp",
                          **config_kwargs) -> DraftHead:
    """An untrained head: the target's last layer, the projection passing h_i through and ignoring the token
    (EAGLE-3: passing the high layer through, see `init_eagle3_from_target`).

    It drafts what one more pass of the last layer over h_i would say: a real but weak guess (low acceptance),
    which is what tests of the speculation machinery need before trained heads exist. Llama targets.
    """
    if target.config.model_type != "llama":
        raise HeadLoadError(f"untrained heads are built from Llama targets only, not {target.config.model_type!r}")
    identity = target_identity(target_name, target.config, target_digest(target))
    config = head_config_for(target.config, identity, architecture, **config_kwargs)
    param = next(target.parameters())
    head = head_module(config).to(device=param.device, dtype=param.dtype)  # the target's: they share weights
    if architecture == "block":
        return init_block_from_target(head.attach(shared_weights(target)), target)
    if architecture == "eagle3":
        return init_eagle3_from_target(head.attach(shared_weights(target)), target)
    head.init_identity_projection()
    with torch.no_grad():
        wanted = head.layer.state_dict().keys()  # without its input norm when the head drops it (eagle1)
        head.layer.load_state_dict({k: v for k, v in target.model.layers[-1].state_dict().items() if k in wanted})
        if config.final_norm:
            head.final_norm.weight.copy_(target.model.norm.weight)
    return head.attach(shared_weights(target))


# --- the head folder -----------------------------------------------------------------------------------------
HEAD_FILES = ("config.json", "model.safetensors")


def save_head(head: DraftHead, out: str | Path, overwrite: bool = True) -> Path:
    """Write config.json + model.safetensors atomically (a temp folder renamed into place).

    An existing `out` is replaced only when it holds nothing but a head's two files (and overwrite is true).
    """
    out = Path(out)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    with atomic_folder(out, owned=HEAD_FILES, overwrite=overwrite) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(asdict(head.config), indent=2) + "\n")
    return out


def read_head_config(path: str | Path) -> MTPHeadConfig:
    """A head folder's config.json, checked (its weights file must be there too)."""
    path = Path(path)
    if not path.is_dir():
        raise HeadLoadError(f"head folder {path} does not exist (expected config.json + model.safetensors)")
    config_file = path / "config.json"
    for file in (config_file, path / "model.safetensors"):
        if not file.is_file():
            raise HeadLoadError(f"{file} is missing: expected a head folder (config.json + model.safetensors)")
    try:
        config = MTPHeadConfig(**json.loads(config_file.read_text()))
    except (json.JSONDecodeError, TypeError) as err:
        raise HeadLoadError(f"{config_file} is not a head config: {err}") from err
    if config.format_version != HEAD_FORMAT_VERSION:
        raise HeadLoadError(f"{config_file}: head format {config.format_version}, this runtime reads {HEAD_FORMAT_VERSION}")
    return config


def read_head(path: str | Path) -> DraftHead:
    """A head folder on the CPU, unattached (export needs no target): config.json + model.safetensors, checked."""
    head = head_module(read_head_config(path))
    weights_file = Path(path) / "model.safetensors"
    load_weights(head, load_file(str(weights_file)), weights_file)
    return head


def load_weights(head: DraftHead, state: dict[str, torch.Tensor], source: Path) -> None:
    """Fill `head` from a state dict read from `source`; a missing, unexpected or misshapen tensor names it."""
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape that does not match the config
        raise HeadLoadError(f"{source}: {str(err).splitlines()[-1].strip()}") from err
    if missing or unexpected:
        raise HeadLoadError(f"{source}: missing {missing[:4]}, unexpected {unexpected[:4]}")


def copy_head(head: DraftHead) -> DraftHead:
    """A detached copy of a head's config and weights (the trainer's module stays as it is), attached to the same
    target tensors as the original when it is (they are the target's: referenced, never copied)."""
    copy = head_module(head.config)
    copy.load_state_dict({name: tensor.detach() for name, tensor in head.state_dict().items()})
    return copy.attach(head.shared) if head.shared is not None else copy


def attach_to_target(head: DraftHead, target: nn.Module, dtype: torch.dtype | None = None,
                     where: str = "the head") -> DraftHead:
    """The head as the runtime serves it: checked against `target`, on its device, in `dtype` (default the
    target's), frozen, and reading the target's own embedding and lm_head."""
    check_target(head.config, target, where)
    param = next(target.parameters())
    head = head.to(device=param.device, dtype=dtype or param.dtype).eval().requires_grad_(False)
    return head.attach(shared_weights(target))


def shared_weights(target: nn.Module) -> SharedTargetWeights:
    """What a head uses of a loaded target: its embedding, lm_head and final norm, in place."""
    return SharedTargetWeights(target.model.embed_tokens, target.lm_head, target.model.norm)


def load_head(path: str | Path, target: nn.Module, dtype: torch.dtype | None = None, lean: bool = True) -> DraftHead:
    """Load a head folder against `target`, refusing a head trained for a different target; lean: served without
    nn.Module's per-call machinery (`infer.loader.serve_lean`)."""
    head = attach_to_target(read_head(path), target, dtype, where=str(Path(path) / "config.json"))
    return serve_lean(head) if lean else head
