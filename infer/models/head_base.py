"""What every draft head shares, apart from any one architecture: its config (the head folder's config.json), the
target's tensors it references, the error a bad head raises, and the `DraftHead` base class.

infer.models.mtp_head (MTP / EAGLE-1, and the head folder API) and infer.models.eagle3_head build on it; both are
imported through mtp_head, which re-exports these names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import DeepseekV2Config, LlamaConfig, PretrainedConfig

from infer.models.common import ModelOutput, final_logits

HEAD_FORMAT_VERSION = 1
HIDDEN_STATES = ("pre_norm", "post_norm")  # which of the target's last-layer states the head reads (MTPHeadConfig)
MLPS = ("dense", "moe")  # a DeepSeek-V2 head's MLP: one dense MLP, or the target's routed + shared experts


class HeadLoadError(ValueError):
    """A head folder that cannot serve this target; the message names the file or field."""


def repeat_kv_heads(fused: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, who: str) -> torch.Tensor:
    """A target layer's fused q/k/v rows with each key and value head repeated for a head layer of `num_kv_heads`
    (query head h reads key/value head h // group in both): the same function, with values as wide as the queries
    (the only path by which a token reaches an EAGLE-3 or block layer). `who` names the layer in the error."""
    q_rows = num_heads * head_dim
    target_kv = (fused.shape[0] - q_rows) // (2 * head_dim)
    if target_kv == num_kv_heads:
        return fused
    if target_kv == 0 or num_kv_heads % target_kv:
        raise HeadLoadError(f"{who} of {num_kv_heads} key/value heads cannot start from a target layer of "
                            f"{target_kv}: num_key_value_heads must be a multiple of the target's")
    k, v = fused[q_rows:].chunk(2)
    repeat = lambda rows: rows.unflatten(0, (target_kv, -1)).repeat_interleave(  # noqa: E731
        num_kv_heads // target_kv, dim=0).flatten(0, 1)
    return torch.cat((fused[:q_rows], repeat(k), repeat(v)))


@dataclass
class MTPHeadConfig:
    hidden_size: int
    vocab_size: int
    decoder: dict  # the decoder layer's config (a LlamaConfig dict: heads, head_dim, intermediate size, rope, eps)
    enorm: bool = True
    hnorm: bool = True
    final_norm: bool = True
    proj_bias: bool = False
    layer_input_norm: bool = True  # the decoder layer's own input RMSNorm (EAGLE-1's first layer has none)
    rms_norm_eps: float = 1e-5
    architecture: str = "mtp"  # "mtp" (norms on), "eagle1" (no norms, biased projection) or "eagle3"
    target: dict = field(default_factory=dict)  # {"name", "hidden_size", "vocab_size", "shared_tensors_sha256"}
    format_version: int = HEAD_FORMAT_VERSION
    decoder_type: str = "llama"  # "llama" or "deepseek_v2" (MLA attention, dense MLP)
    recommended_k: dict = field(default_factory=dict)  # batch size -> K, from a validation (mtp_train.export --report)
    # "pre_norm": h_i is the target's last-layer output as the runtime returns it; "post_norm": after the target's
    # final norm, as vLLM and SGLang feed EAGLE-1/2 and NextN drafters. Later draft steps read the head's own h'.
    hidden_state: str = "pre_norm"
    mlp: str = "dense"  # DeepSeek-V2 decoders: "dense" or "moe" (the target's experts, as NextN builds its layer)
    # EAGLE-3 only (infer.models.eagle3_head): the target layer ids fused at step 0, the draft vocabulary's size
    # (None: the target's whole vocabulary), whether the head owns its lm_head rows (else the target's, shared) and
    # whether its residual stream starts from the normed fused state (else the fused state itself)
    aux_layer_ids: list[int] = field(default_factory=list)
    draft_vocab_size: int | None = None
    trainable_lm_head: bool = False
    norm_before_residual: bool = False
    # block heads only (infer.models.block_head): rows of the query block (the pending token + block_size - 1 mask
    # rows, i.e. block_size - 1 drafts a forward) and decoder layers; the mask rows embed as the target's token
    # mask_token_id (a reserved id, as the engines' DFlash drafters read it), or None: a learned mask embedding
    block_size: int = 0
    num_layers: int = 1
    mask_token_id: int | None = None
    qk_norm: bool = False  # Qwen3's per-head q/k RMSNorm in each block layer (the engines' DFlash layers have it)
    # the mask rows also read the anchor: a linear of [c_{p-1}; Emb(t_p)] added to each (infer.models.block_head)
    anchor_input: bool = False

    def num_draft_tokens_for(self, batch_size: int) -> int | None:
        """The recommended K at the largest measured batch size <= batch_size (the smallest one below them all); 0
        where the validation predicted plain decoding faster than every K."""
        if not self.recommended_k:
            return None
        sizes = sorted(int(b) for b in self.recommended_k)
        fitting = [b for b in sizes if b <= batch_size] or sizes[:1]
        return int(self.recommended_k[str(fitting[-1])])

    def decoder_config(self) -> PretrainedConfig:
        if self.hidden_state not in HIDDEN_STATES:
            raise HeadLoadError(f"hidden_state {self.hidden_state!r}: expected one of {', '.join(HIDDEN_STATES)}")
        if self.mlp not in MLPS or (self.mlp == "moe" and self.decoder_type != "deepseek_v2"):
            raise HeadLoadError(f"mlp {self.mlp!r} with decoder_type {self.decoder_type!r}: 'moe' needs a DeepSeek-V2 "
                                "decoder, otherwise 'dense'")
        if self.decoder_type == "llama":
            return LlamaConfig(**self.decoder)
        if self.decoder_type == "deepseek_v2":
            # built as layer 0: before the first MoE layer (a dense MLP of `intermediate_size`, the dense-layer
            # width), or, for mlp="moe", as an MoE layer like the target's
            return DeepseekV2Config(**{**self.decoder, "first_k_dense_replace": 1 if self.mlp == "dense" else 0})
        raise HeadLoadError(f"unknown decoder_type {self.decoder_type!r}: expected 'llama' or 'deepseek_v2'")


@dataclass
class SharedTargetWeights:
    """The target's embedding, output projection and final norm, referenced (not registered) so a head never saves
    them; the norm turns the target's states into a post_norm head's input."""

    embed_tokens: nn.Embedding
    lm_head: nn.Linear
    final_norm: nn.Module | None = None


class DraftHead(nn.Module):
    """What every draft head shares: one decoder layer with its own KV cache, the target's tensors by reference,
    and the hooks the drafter (infer.speculative) and the trainer (mtp_train.unroll) call.

    Subclasses build `layer` (with `self_attn`), `final_norm` and `rotary_emb`, set `mla`, and implement `forward`.
    """

    config: MTPHeadConfig
    layer: nn.Module
    mla: bool = False
    target_aux_layers: tuple[int, ...] = ()  # infer aux layers of the target's forward that `features` reads

    def __init__(self, config: MTPHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.shared: SharedTargetWeights | None = None

    def attach(self, shared: SharedTargetWeights) -> "DraftHead":
        """Point the head at the target's embedding and lm_head (in place, no copy)."""
        embed = shared.embed_tokens  # the whole table's size, also when tensor parallelism splits its rows
        if (embed.num_embeddings, embed.embedding_dim) != (self.config.vocab_size, self.config.hidden_size):
            raise HeadLoadError(
                f"head expects a target with vocab {self.config.vocab_size} and hidden size {self.config.hidden_size}, "
                f"the target has {(embed.num_embeddings, embed.embedding_dim)}"
            )
        self.shared = shared
        return self

    def features(self, hidden_states: torch.Tensor, aux_hidden_states: torch.Tensor | None = None) -> torch.Tensor:
        """The state step 0 reads at position i from the target: its last layer's h_i [T, H] (aux unused), through
        the target's final norm for a post_norm head. The runtime, the trainer and validation all call this, so
        they feed the same input."""
        if self.config.hidden_state == "pre_norm":
            return hidden_states
        if self.shared is None or self.shared.final_norm is None:
            raise HeadLoadError("a post_norm head needs the target's final norm: attach it with the target's weights")
        return self.shared.final_norm(hidden_states)

    def lm_head_weight(self) -> torch.Tensor:
        """[draft vocab, H] the output rows the head scores (MTP: the target's whole lm_head)."""
        return self.shared.lm_head.weight

    def draft_token_ids(self) -> torch.Tensor | None:
        """[draft vocab] the target id of each draft logit, None when the draft vocabulary is the target's."""
        return None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return final_logits(self.final_norm, self.shared.lm_head, hidden_states)

    def output(self, x: torch.Tensor, attn, logits_indices: torch.Tensor | None) -> ModelOutput:
        """Logits at logits_indices (None: every row) and every row's hidden state; where the backend computed the
        step's output rows alone (attn.output_rows: the rows scored), x holds those rows only."""
        if attn.output_rows is not None or logits_indices is None:
            return ModelOutput(self.compute_logits(x), x)
        return ModelOutput(self.compute_logits(x[logits_indices]), x)

    # --- KV cache: one layer (Llama: K/V pages; DeepSeek-V2: latent and rope-key pages) ----------
    def allocate_kv_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> list:
        attn = self.layer.self_attn
        if self.mla:
            return [(torch.zeros((num_pages, page_size, attn.kv_lora_rank), dtype=dtype, device=device),
                     torch.zeros((num_pages, page_size, attn.qk_rope_head_dim), dtype=dtype, device=device))]
        return [torch.zeros((num_pages, 2, page_size, attn.num_kv_heads, attn.head_dim), dtype=dtype, device=device)]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        attn = self.layer.self_attn
        elem = torch.tensor([], dtype=dtype).element_size()
        if self.mla:
            return (attn.kv_lora_rank + attn.qk_rope_head_dim) * elem
        return 2 * attn.num_kv_heads * attn.head_dim * elem

    def attention_dims(self) -> dict:
        attn = self.layer.self_attn
        if self.mla:
            rank, rope_dim = attn.kv_lora_rank, attn.qk_rope_head_dim
            return dict(num_heads=attn.num_heads, num_kv_heads=1, head_dim=rank + rope_dim, mla_dims=(rank, rope_dim))
        return dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, mla_dims=None)
