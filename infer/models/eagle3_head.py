"""The EAGLE-3 draft head (Li et al., 2025) as the runtime serves it.

Step 0 at position i reads the target's hidden states at three layers (low, mid, high), fused, and the next token:

    g_i  = fc([h^low_i ; h^mid_i ; h^high_i])                     # bias-free, 3H -> H
    a_i  = [input_layernorm(Emb(t_{i+1})) ; hidden_norm(g_i)]      # 2H wide: q, k and v read both halves
    x_i  = r_i + o_proj(attention(qkv_proj(a_i)))                  # r_i: the residual stream's start (below)
    h'_i = x_i + mlp(post_attention_layernorm(x_i))
    p    = softmax(lm_head(final_norm(h'_i)))                      # over the draft vocabulary

r_i is the fused state g_i itself, or with `norm_before_residual` its normed hidden_norm(g_i), as vLLM's and the
speculators package's EAGLE-3 layers read their config's flag (SGLang's layer has no flag: g_i). Normed, the token's
contribution through attention is not drowned by the scale of the target's residual stream, which raised tau
(conf/head/eagle3.yaml's default; figures in docs/benchmark_history.md, "Recipes").

A later draft reads the layer's own output h' (before the final norm) where step 0 read g_i; it is trained that
way (mtp_train.ttt). Emb is the target's, frozen and shared; the decoder layer is Llama-shaped (EAGLE-3's).

Layer ids: id i is the residual stream entering decoder layer i, i.e. transformers' `hidden_states[i]`, i.e.
infer's aux output of decoder layer i - 1 (`ModelOutput.aux_hidden_states[i - 1]`, stored by the precompute as
`aux_hidden_states.{i - 1}`); ids lie in 1..L. The default is (2, L//2, L-3), the layers vLLM and SGLang
capture. Where those are not strictly increasing (L < 7; stories260K has 5 layers) the rule is (1, L//2, L-1):
the first layer's output, the middle one, and the stream entering the last layer. Fewer than 4 layers is refused.
Id L, the last layer's output before the final norm (what an MTP head reads), is served by this runtime only:
vLLM and SGLang capture streams entering layers 0..L-1, so the eagle3 and speculators exports refuse it.

Draft vocabulary, as in EAGLE-3's checkpoints: `d2t` [Vd] int64 offsets (target id = draft id + d2t[draft id]) and
`t2d` [V] bool (whether a target id is drafted); mtp_train.draft_vocab chooses it. The head scores the target's own
lm_head rows at those ids, frozen and shared (default), or its own `lm_head.weight` [Vd, H] (trainable_lm_head,
EAGLE-3's choice). Logits outside the draft vocabulary are -inf: those tokens are never proposed, q is 0 there,
and rejection sampling stays lossless (its residual max(p - q, 0) gives them their full mass).

Keys (names equal to the module's): fc.weight, layer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight,
layer.self_attn.{qkv_proj,o_proj}.weight, layer.mlp.{gate_up_proj,down_proj}.weight, final_norm.weight, d2t, t2d,
and lm_head.weight when trainable. The folder format is infer.models.mtp_head's.

Under tensor parallelism the head shards like the target's layers (query/KV heads and MLP columns per rank; fc, the
norms and a trainable lm_head whole on every rank) and every rank runs its forwards; with the target's lm_head, whose
vocabulary rows are split, it scores the whole gathered vocabulary and keeps the draft ids (the same logits).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, PretrainedConfig

from infer.attention import AttentionBackend, cast
from infer.models.common import ModelOutput, RMSNorm, RotaryEmbedding, keep_output_rows
from infer.models.head_base import DraftHead, HeadLoadError, MTPHeadConfig, repeat_kv_heads
from infer.models.llama import LlamaAttention, LlamaMLP
from infer.parallel import ParallelLMHead, TPGroup, current, whole_weight

NUM_FUSED_LAYERS = 3


def default_layer_ids(num_layers: int) -> list[int]:
    """(2, L//2, L-3), or (1, L//2, L-1) where those are not strictly increasing (module docstring)."""
    ids = [2, num_layers // 2, num_layers - 3]
    if not 0 < ids[0] < ids[1] < ids[2] < num_layers:
        ids = [1, num_layers // 2, num_layers - 1]
    if not 0 < ids[0] < ids[1] < ids[2] < num_layers:
        raise HeadLoadError(f"EAGLE-3 fuses 3 distinct target layers: a target of {num_layers} layers has too few")
    return ids


def check_layer_ids(ids: list[int], num_layers: int) -> list[int]:
    ids = [int(i) for i in ids]
    if len(ids) != NUM_FUSED_LAYERS or len(set(ids)) != NUM_FUSED_LAYERS or not all(0 < i <= num_layers for i in ids):
        raise HeadLoadError(f"head.layer_ids={ids}: EAGLE-3 fuses 3 distinct target layer ids in 1..{num_layers} "
                            f"(id i = the residual stream entering decoder layer i; {num_layers}: the last layer's "
                            "output)")
    return ids


def head_aux_layers(target_config: PretrainedConfig, layer_ids: list[int] | None) -> list[int]:
    """The infer aux layers (decoder layer i's output) an EAGLE-3 head with these ids reads: id - 1 each."""
    num_layers = target_config.num_hidden_layers
    ids = default_layer_ids(num_layers) if layer_ids is None else check_layer_ids(list(layer_ids), num_layers)
    return [i - 1 for i in ids]


def eagle3_config_fields(target_config: PretrainedConfig, layer_ids: list[int] | None, draft_vocab_size: int | None,
                         trainable_lm_head: bool, norm_before_residual: bool = False) -> dict:
    """MTPHeadConfig's EAGLE-3 fields for a target, checked (HeadLoadError naming the value)."""
    if target_config.model_type != "llama":
        raise HeadLoadError(f"EAGLE-3 heads are built for Llama targets, not {target_config.model_type!r}")
    num_layers, vocab = target_config.num_hidden_layers, target_config.vocab_size
    ids = default_layer_ids(num_layers) if layer_ids is None else check_layer_ids(list(layer_ids), num_layers)
    if draft_vocab_size is not None and not 1 <= draft_vocab_size <= vocab:
        raise HeadLoadError(f"head.draft_vocab_size={draft_vocab_size} must be in 1..{vocab} (the target's vocabulary)")
    return dict(aux_layer_ids=ids, draft_vocab_size=draft_vocab_size, trainable_lm_head=bool(trainable_lm_head),
                norm_before_residual=bool(norm_before_residual), enorm=False, hnorm=False, final_norm=True,
                proj_bias=False, layer_input_norm=True)


class Eagle3DecoderLayer(nn.Module):
    """A Llama decoder layer whose q/k/v read [normed embedding ; normed state] (2H) and whose residual is the state
    (normed, with norm_before_residual)."""

    def __init__(self, config: LlamaConfig, tp: TPGroup | None = None, norm_before_residual: bool = False) -> None:
        """tp: the group to shard over (heads, MLP columns, as the target's layers); by default the current one."""
        super().__init__()
        self.norm_before_residual = norm_before_residual
        hidden = config.hidden_size
        tp = tp or current()
        self.self_attn = LlamaAttention(config, tp, in_features=2 * hidden)
        self.mlp = LlamaMLP(hidden, config.intermediate_size, getattr(config, "mlp_bias", False), tp)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)  # of the token's embedding
        self.hidden_norm = RMSNorm(hidden, config.rms_norm_eps)  # of the fused (or own) state
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attn: AttentionBackend, kv_cache: torch.Tensor) -> torch.Tensor:
        """emb, hidden [T, H] -> [T, H]."""
        normed = self.hidden_norm(hidden)
        both = torch.cat((self.input_layernorm(emb), normed), dim=-1)  # [T, 2H]
        residual = normed if self.norm_before_residual else hidden
        x = keep_output_rows(residual, attn) + self.self_attn(both, cos, sin, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(DraftHead):
    def __init__(self, config: MTPHeadConfig) -> None:
        super().__init__(config)
        if config.decoder_type != "llama":
            raise HeadLoadError(f"EAGLE-3 heads have a Llama decoder layer, not {config.decoder_type!r}")
        if len(config.aux_layer_ids) != NUM_FUSED_LAYERS:
            raise HeadLoadError(f"an EAGLE-3 head config needs {NUM_FUSED_LAYERS} aux_layer_ids, got "
                                f"{config.aux_layer_ids}")
        hidden, vocab = config.hidden_size, config.vocab_size
        draft_vocab = config.draft_vocab_size or vocab
        decoder_config = config.decoder_config()
        self.fc = nn.Linear(NUM_FUSED_LAYERS * hidden, hidden, bias=False)
        self.layer = Eagle3DecoderLayer(decoder_config, norm_before_residual=config.norm_before_residual)
        self.final_norm = RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False) if config.trainable_lm_head else None
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
        self.register_buffer("t2d", torch.arange(vocab) < draft_vocab)
        self.rotary_emb = RotaryEmbedding(decoder_config, self.layer.self_attn.head_dim)
        self.target_aux_layers = tuple(i - 1 for i in config.aux_layer_ids)
        self.full_vocab = draft_vocab == vocab  # then the map is the identity (ids are distinct and sorted)

    # --- the draft vocabulary --------------------------------------------------------------------------------
    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft ids 0..Vd-1 stand for these target ids (sorted ascending: d2t offsets are then >= 0)."""
        token_ids = token_ids.to(self.d2t.device).long().sort().values
        if token_ids.numel() != self.d2t.numel() or token_ids.unique().numel() != token_ids.numel():
            raise HeadLoadError(f"a draft vocabulary of {self.d2t.numel()} distinct ids is needed, got "
                                f"{token_ids.numel()} ({token_ids.unique().numel()} distinct)")
        self.d2t.copy_(token_ids - torch.arange(token_ids.numel(), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def draft_token_ids(self) -> torch.Tensor | None:
        if self.full_vocab:
            return None
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def lm_head_weight(self) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head.weight
        ids = self.draft_token_ids()
        shared = self.shared.lm_head.weight
        return shared if ids is None else shared[ids]

    # --- forward --------------------------------------------------------------------------------------------
    def features(self, hidden_states: torch.Tensor, aux_hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """aux_hidden_states [T, 3, H] (the layers of `target_aux_layers`, in order) -> fused g [T, H]."""
        if aux_hidden_states is None:
            raise HeadLoadError(f"an EAGLE-3 head reads target layers {self.config.aux_layer_ids}: none were given")
        return self.fc(cast(aux_hidden_states.flatten(1), self.fc.weight.dtype))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor | None = None,
        hidden_states: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids [T] are t_{i+1}; hidden_states [T, H] are g_i (step 0) or the head's own h'; positions [T]; the
        outputs as `DraftHead.output` gives them."""
        assert self.shared is not None, "attach() the target's weights first"
        assert hidden_states is not None, "the head needs the fused target states or its own"
        dtype = self.fc.weight.dtype
        emb = cast(self.shared.embed_tokens(input_ids), dtype)
        cos, sin = self.rotary_emb.tables(positions, emb)
        x = self.layer(emb, cast(hidden_states, dtype), cos, sin, attn, kv_caches[0])
        return self.output(x, attn, logits_indices)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the target's vocabulary: the draft vocabulary's, -inf everywhere else."""
        normed = self.final_norm(hidden_states)
        if self.lm_head is None and isinstance(self.shared.lm_head, ParallelLMHead):
            # the target's rows are split over the ranks: score its whole vocabulary (gathered), keep the draft ids
            lm_head = self.shared.lm_head
            logits = cast(lm_head(cast(normed, lm_head.weight.dtype)), torch.float32)  # [N, V]
            return logits if self.full_vocab else logits.masked_fill_(~self.t2d, float("-inf"))
        weight = self.lm_head_weight()
        draft = cast(F.linear(cast(normed, weight.dtype), weight), torch.float32)  # [N, Vd]
        if self.full_vocab:
            return draft
        full = draft.new_full((draft.shape[0], self.config.vocab_size), float("-inf"))
        return full.index_copy_(1, self.draft_token_ids(), draft)

    # --- starting points ------------------------------------------------------------------------------------
    def init_identity_projection(self) -> None:
        """fc = [0 | 0 | I]: the head starts from the high layer's state alone."""
        hidden = self.config.hidden_size
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, 2 * hidden:] = torch.eye(hidden)

    def load_target_layer(self, layer: dict[str, torch.Tensor]) -> None:
        """Start the decoder layer from a target layer's parameters (infer's fused names: self_attn.qkv_proj, ...).

        q/k/v read the state half only (the embedding half starts at zero and learns), hidden_norm is the target
        layer's input norm and the embedding's norm starts at ones: the untrained head runs that target layer on
        the fused state, a real but weak guess. A head with more key/value heads than the target's layer
        (num_key_value_heads) starts with each of the target's repeated for the query heads it served: the same
        function."""
        with torch.no_grad():
            qkv = self.layer.self_attn.qkv_proj
            qkv.weight.zero_()
            qkv.weight[:, self.config.hidden_size:] = self._kv_heads_repeated(layer["self_attn.qkv_proj.weight"])
            if qkv.bias is not None:
                qkv.bias.copy_(self._kv_heads_repeated(layer["self_attn.qkv_proj.bias"]))
            self.layer.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
            self.layer.input_layernorm.weight.fill_(1.0)
            own = ("self_attn.qkv_proj.", "input_layernorm.", "hidden_norm.")
            missing, unexpected = self.layer.load_state_dict(
                {k: v for k, v in layer.items() if not k.startswith(own)}, strict=False)
            missing = [k for k in missing if not k.startswith(own)]
            if missing or unexpected:
                raise HeadLoadError(f"an EAGLE-3 layer from a target layer: missing {missing[:4]}, unexpected "
                                    f"{unexpected[:4]}")

    def _kv_heads_repeated(self, fused: torch.Tensor) -> torch.Tensor:
        attn = self.layer.self_attn
        return repeat_kv_heads(fused, attn.num_heads, attn.num_kv_heads, attn.head_dim, "an EAGLE-3 layer")

    def share_lm_head_rows(self) -> None:
        """A trainable lm_head starts from the target's rows at the draft ids."""
        if self.lm_head is not None:
            ids = self.draft_token_ids()
            shared = whole_weight(self.shared.lm_head)  # under tensor parallelism: gathered (every rank calls this)
            with torch.no_grad():
                self.lm_head.weight.copy_(shared if ids is None else shared[ids])


def init_eagle3_from_target(head: Eagle3Head, target: nn.Module) -> Eagle3Head:
    """An untrained EAGLE-3 head on an infer Llama target: fc passes the high layer through, the layer is the
    target's last one reading the state half, the final norm the target's (see `Eagle3Head.load_target_layer`)."""
    head.init_identity_projection()
    head.load_target_layer(target.model.layers[-1].state_dict())
    with torch.no_grad():
        head.final_norm.weight.copy_(target.model.norm.weight)
    return head
