"""DeepSeek-V2 / V2-Lite: multi-head latent attention (MLA) and DeepSeekMoE on the paged KV cache.

MLA runs in its absorbed form, so the cache holds per token only the compressed latent (kv_lora_rank) and the
rotated rope key (qk_rope_head_dim), shared by all heads, instead of full per-head K and V:
  - the no-rope part of each query is multiplied by W_UK (the key half of kv_b_proj) into latent space, so
    scores are q_latent . latent + q_rope . k_rope;
  - values are the latents themselves; W_UV (the value half of kv_b_proj) maps the attention output back.
Module names mirror the Hugging Face hub checkpoint keys (per-expert MLPs); `checkpoint_renames` also accepts
transformers-5's fused expert tensors. Semantics follow transformers' DeepseekV2ForCausalLM, plus the original
DeepSeek code's `moe_layer_freq` and `norm_topk_prob`, which transformers ignores.

Under tensor parallelism (`tp`, infer.parallel) a rank holds its heads' rows of q_proj / q_b_proj and
kv_b_proj and their columns of o_proj; the latent projections, their norms and the latent cache are replicated
(every rank attends over the same latents with its own heads). Routed experts are expert-parallel (rank r owns
experts r, r + tp, ...; the router is replicated), shared experts and dense MLPs split like Llama's MLP.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.activations import ACT2FN

from infer.attention import AttentionBackend
from infer.models.common import (
    ModelOutput, RMSNorm, RotaryEmbedding, apply_rope_interleaved, final_logits, keep_output_rows, run_decoder_layers,
)
from infer.parallel import TPGroup, check_split, column_linear, current, lm_head_linear, row_linear, vocab_embedding

if TYPE_CHECKING:
    from infer.loader import CheckpointTensor

# transformers-5 state dicts store each MoE layer's experts as two 3-D tensors.
_FUSED_EXPERTS_KEY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config: PretrainedConfig) -> float:
    """qk_head_dim**-0.5, times YaRN's mscale(factor, mscale_all_dim)**2 when rope is scaled (DeepSeek's choice)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = getattr(config, "rope_parameters", None) or {}
    mscale_all_dim = params.get("mscale_all_dim") or 0
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        scale *= yarn_mscale(params["factor"], mscale_all_dim) ** 2
    return scale


def is_moe_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """The original DeepSeek rule: routed experts from layer first_k_dense_replace on, every moe_layer_freq layers."""
    return (
        getattr(config, "n_routed_experts", None) is not None
        and layer_idx >= config.first_k_dense_replace
        and layer_idx % getattr(config, "moe_layer_freq", 1) == 0
    )


def tp_split_fields(config: PretrainedConfig) -> dict[str, int]:
    """The sizes tensor parallelism splits evenly (routed experts are dealt out and need not split)."""
    fields = {"vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads}
    if not all(is_moe_layer(config, i) for i in range(config.num_hidden_layers)):
        fields["intermediate_size"] = config.intermediate_size
    if getattr(config, "n_shared_experts", None) and any(is_moe_layer(config, i) for i in range(config.num_hidden_layers)):
        fields["moe_intermediate_size * n_shared_experts"] = config.moe_intermediate_size * config.n_shared_experts
    return fields


class DeepseekV2Attention(nn.Module):
    """MLA. Projections as in the checkpoint; attention itself in the absorbed (latent-space) form."""

    def __init__(self, config: PretrainedConfig, tp: TPGroup) -> None:
        super().__init__()
        heads = config.num_attention_heads
        lo, hi = tp.span(heads, "num_attention_heads")
        self.num_heads = hi - lo  # this rank's
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scale = softmax_scale(config)
        hidden, bias = config.hidden_size, config.attention_bias
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        kv_head_dim = self.qk_nope_head_dim + self.v_head_dim
        if self.q_lora_rank is None:
            self.q_proj = column_linear(hidden, heads * qk_head_dim, [(lo * qk_head_dim, hi * qk_head_dim)], False, tp)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank)  # default eps, as in the reference
            self.q_b_proj = column_linear(self.q_lora_rank, heads * qk_head_dim,
                                          [(lo * qk_head_dim, hi * qk_head_dim)], False, tp)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = column_linear(self.kv_lora_rank, heads * kv_head_dim, [(lo * kv_head_dim, hi * kv_head_dim)],
                                       False, tp)
        self.o_proj = row_linear(heads * self.v_head_dim, hidden, (lo * self.v_head_dim, hi * self.v_head_dim), bias, tp)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        tokens = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(tokens, self.num_heads, -1).split([self.qk_nope_head_dim, self.qk_rope_head_dim], -1)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)  # [T, H, Dr]

        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], -1)
        latent = self.kv_a_layernorm(latent)  # [T, R]
        k_rope = apply_rope_interleaved(k_rope[:, None], cos, sin)[:, 0]  # [T, Dr], one head shared by all

        # kv_b_proj maps a latent to every head's [k_nope ; v]: its weight is [H, dn + dv, R] = [W_UK ; W_UV].
        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=1)
        q_latent = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [T, H, R]
        ckv_cache, kpe_cache = kv_cache
        out_latent = attn.attend_mla(q_latent, q_rope, latent, k_rope, ckv_cache, kpe_cache, self.scale)
        out = torch.einsum("thr,hvr->thv", out_latent.to(w_uv.dtype), w_uv)  # [T or len(attn.output_rows), H, dv]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.v_head_dim))


class DeepseekV2MLP(nn.Module):
    """Gated MLP: the dense layers, each routed expert and the shared experts.

    tp splits the intermediate features (dense layers, shared experts); routed experts are whole (the default).
    reduce=False leaves the sum over ranks to the caller (the MoE block reduces once).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False,
                 tp: TPGroup = TPGroup(), reduce: bool = True) -> None:
        super().__init__()
        lo, hi = tp.span(intermediate_size, "intermediate_size")
        self.gate_proj = column_linear(hidden_size, intermediate_size, [(lo, hi)], bias, tp)
        self.up_proj = column_linear(hidden_size, intermediate_size, [(lo, hi)], bias, tp)
        self.down_proj = row_linear(intermediate_size, hidden_size, (lo, hi), bias, tp, reduce)
        self.act_fn = ACT2FN[hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV2Gate(nn.Module):
    """Router: fp32 softmax over experts, greedy or group-limited greedy top-k, then the weights' scaling."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.topk_method = config.topk_method
        self.num_groups = config.n_group
        self.topk_group = config.topk_group
        self.routed_scaling_factor = config.routed_scaling_factor
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        scoring = getattr(config, "scoring_func", "softmax")
        if scoring != "softmax":
            raise ValueError(f"DeepSeek-V2 routing supports scoring_func 'softmax', config has {scoring!r}")
        if self.topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"unsupported topk_method {self.topk_method!r}: choose greedy or group_limited_greedy")
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> expert ids [T, K] (int64), weights [T, K] (fp32)."""
        scores = F.linear(x.float(), self.weight.float()).softmax(dim=-1)  # [T, E]
        if self.topk_method == "group_limited_greedy":
            # Keep only experts in the topk_group groups whose best expert scores highest.
            group_scores = scores.view(-1, self.num_groups, self.num_experts // self.num_groups).amax(dim=-1)
            group_idx = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
            group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            expert_mask = group_mask.repeat_interleave(self.num_experts // self.num_groups, dim=1)  # [T, E]
            scores = scores.masked_fill(~expert_mask, 0.0)
        weights, expert_ids = scores.topk(self.top_k, dim=-1, sorted=False)
        # DeepSeek-V2's original rule: either renormalise the top-k or scale them, never both.
        if self.top_k > 1 and self.norm_topk_prob:
            return expert_ids, weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return expert_ids, weights * self.routed_scaling_factor


class DeepseekV2MoE(nn.Module):
    """Routed experts (each token to its top-k) plus always-on shared experts.

    `experts` holds this rank's experts under their checkpoint indices; `tp_foreign_params` names the others',
    which the loader skips.
    """

    def __init__(self, config: PretrainedConfig, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.gate = DeepseekV2Gate(config)
        owned = range(tp.rank, self.num_experts, tp.size)
        self.experts = nn.ModuleDict(
            {str(e): DeepseekV2MLP(config.hidden_size, config.moe_intermediate_size, config.hidden_act) for e in owned}
        )
        self.tp_foreign_params = [f"experts.{e}.{proj}.weight" for e in range(self.num_experts) if e not in owned
                                  for proj in ("gate_proj", "up_proj", "down_proj")]
        n_shared = getattr(config, "n_shared_experts", None) or 0
        self.shared_experts = (
            DeepseekV2MLP(
                config.hidden_size,
                config.moe_intermediate_size * n_shared,
                config.hidden_act,
                getattr(config, "mlp_bias", False),
                tp,
                reduce=False,
            )
            if n_shared
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden]: tokens are grouped by expert with one sort, then each hit expert of this rank runs once."""
        expert_ids, weights = self.gate(x)  # [T, K]
        flat_ids = expert_ids.flatten()  # [T*K], entry i is token i // K
        order = flat_ids.argsort(stable=True)
        token_of_slot = order // self.top_k  # [T*K] tokens grouped by expert
        weight_of_slot = weights.flatten()[order, None]  # [T*K, 1] fp32
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        ends = list(itertools.accumulate(counts))
        out = torch.zeros_like(x)
        for key, expert in self.experts.items():
            end, count = ends[int(key)], counts[int(key)]
            if count == 0:
                continue
            tokens = token_of_slot[end - count : end]
            y = expert(x[tokens]) * weight_of_slot[end - count : end]
            out.index_add_(0, tokens, y.to(out.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)  # this rank's part of the shared experts' output
        return self.tp.all_reduce(out)


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        """tp: the group to shard over; by default the current one (so an MTP head's layer shards like its target)."""
        super().__init__()
        tp = tp or current()
        self.self_attn = DeepseekV2Attention(config, tp)
        if is_moe_layer(config, layer_idx):
            self.mlp: nn.Module = DeepseekV2MoE(config, tp)
        else:
            self.mlp = DeepseekV2MLP(
                config.hidden_size, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False), tp
            )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attn: AttentionBackend,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        x = keep_output_rows(x, attn) + out
        return x + self.mlp(self.post_attention_layernorm(x))


class DeepseekV2Model(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(DeepseekV2DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, config.qk_rope_head_dim)


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or current()
        check_split(self.tp, tp_split_fields(config))
        self.model = DeepseekV2Model(config, self.tp)
        self.lm_head = lm_head_linear(config.hidden_size, config.vocab_size, self.tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_renames(key: str, tensor: CheckpointTensor, config: PretrainedConfig) -> list[tuple]:
        """Split transformers-5's fused experts into the hub's per-expert tensors; other keys pass through.

        gate_up_proj [E, 2I, H] -> experts.e.gate_proj.weight [I, H] (first half) and up_proj (second half);
        down_proj [E, H, I] -> experts.e.down_proj.weight [H, I].
        """
        match = _FUSED_EXPERTS_KEY.match(key)
        if match is None:
            return [(key, tensor)]
        prefix, kind = match.groups()
        if kind == "down_proj":
            return [(f"{prefix}.{e}.down_proj.weight", tensor[e]) for e in range(tensor.shape[0])]
        gate, up = tensor.chunk(2, dim=1)
        return [
            (f"{prefix}.{e}.{name}.weight", half[e])
            for e in range(tensor.shape[0])
            for name, half in (("gate_proj", gate), ("up_proj", up))
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor | None = None,
        aux_layers: Sequence[int] = (),
    ) -> ModelOutput:
        """input_ids, positions [T] packed; attn already planned for this step's page tables."""
        cos, sin = self.model.rotary_emb(positions)
        x, aux = run_decoder_layers(self.model.layers, self.model.embed_tokens(input_ids), cos, sin, attn, kv_caches,
                                    aux_layers)
        return ModelOutput(self.compute_logits(x, logits_indices), x, aux)

    def compute_logits(self, hidden_states: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + lm_head on the chosen rows of the pre-norm hidden states; fp32 logits."""
        return final_logits(self.model.norm, self.lm_head, hidden_states, indices)

    # --- KV cache: per layer the compressed latent and the rope key, not full K/V ----------------
    def kv_cache_shapes(self, num_pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(ckv [P, page_size, kv_lora_rank], kpe [P, page_size, qk_rope_head_dim]): FlashInfer's MLA layout."""
        return (
            (num_pages, page_size, self.config.kv_lora_rank),
            (num_pages, page_size, self.config.qk_rope_head_dim),
        )

    def allocate_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ckv_shape, kpe_shape = self.kv_cache_shapes(num_pages, page_size)
        return [
            (torch.zeros(ckv_shape, dtype=dtype, device=device), torch.zeros(kpe_shape, dtype=dtype, device=device))
            for _ in self.model.layers
        ]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return (self.config.kv_lora_rank + self.config.qk_rope_head_dim) * elem * len(self.model.layers)

    def attention_dims(self) -> dict:
        """Head layout an attention backend plans with: one latent 'KV head' of width kv_lora_rank + rope dim."""
        rank, rope_dim = self.config.kv_lora_rank, self.config.qk_rope_head_dim
        return dict(
            num_heads=self.model.layers[0].self_attn.num_heads,  # this rank's
            num_kv_heads=1,
            head_dim=rank + rope_dim,
            mla_dims=(rank, rope_dim),
        )
