"""Llama (1, 2, 3.x, TinyStories): GQA, RoPE (default and llama3 scaling), tied or untied embeddings.

Module names mirror the Hugging Face checkpoint keys, except that q/k/v and gate/up projections are stored
fused (`qkv_proj`, `gate_up_proj`: one matmul instead of three and two, as vLLM and SGLang do);
`checkpoint_renames` maps the checkpoint's tensors onto their rows. The forward runs one packed batch of
variable-length sequences (no padding) against the paged KV cache.

Under tensor parallelism (`tp`, infer.parallel) a rank holds its heads' rows of qkv_proj (KV heads split, or
replicated when there are fewer than ranks), their columns of o_proj, its slice of the MLP and of the
vocabulary; a fused parameter's shard is the concatenation of its parts' shards.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from transformers import LlamaConfig

from infer.attention import AttentionBackend
from infer.models.common import (
    ModelOutput, RMSNorm, RotaryEmbedding, apply_rope_half, final_logits, keep_output_rows, run_decoder_layers,
)
from infer.models.fused_ops import FusedRope, fused_add_rms_norm, fused_rope, silu_and_mul
from infer.parallel import (
    TPGroup, check_split, column_linear, current, head_spans, lm_head_linear, row_linear, vocab_embedding,
)


def fused_rows(key: str, tensor: torch.Tensor, config: LlamaConfig) -> tuple:
    """A checkpoint tensor -> (parameter, tensor) or, for q/k/v and gate/up, (fused parameter, tensor, first row, rows).

    The tensor passes through untouched (the loader's not-yet-read CheckpointTensor, or a torch.Tensor).
    """
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    inter = config.intermediate_size
    pieces = {
        "q_proj": ("qkv_proj", 0, q_rows), "k_proj": ("qkv_proj", q_rows, kv_rows),
        "v_proj": ("qkv_proj", q_rows + kv_rows, kv_rows),
        "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
    }
    parts = key.split(".")
    if len(parts) >= 2 and parts[-2] in pieces:
        fused, row, rows = pieces[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), tensor, row, rows
    return key, tensor


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup, in_features: int | None = None) -> None:
        """in_features: what q/k/v read (default hidden_size; an EAGLE-3 layer reads [embedding ; state], 2x)."""
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = d = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.scale = self.head_dim**-0.5
        (q_lo, q_hi), (kv_lo, kv_hi) = head_spans(heads, kv_heads, tp)
        self.num_heads, self.num_kv_heads = q_hi - q_lo, kv_hi - kv_lo  # this rank's
        bias = config.attention_bias
        q_rows, kv_rows = heads * d, kv_heads * d
        keep = [(q_lo * d, q_hi * d), (q_rows + kv_lo * d, q_rows + kv_hi * d),
                (q_rows + kv_rows + kv_lo * d, q_rows + kv_rows + kv_hi * d)]  # rows of q, k and v (fused_rows' order)
        self.qkv_proj = column_linear(in_features or config.hidden_size, q_rows + 2 * kv_rows, keep, bias, tp)
        self.o_proj = row_linear(q_rows, config.hidden_size, (q_lo * d, q_hi * d), bias, tp)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        """cos, sin: `RotaryEmbedding.tables` (a `FusedRope` and None: one kernel rotates q and k in place)."""
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if isinstance(cos, FusedRope):
            d = self.head_dim
            fused_rope(qkv, self.num_heads * d, self.num_kv_heads * d, d, cos)
            q, k, v = qkv.view(tokens, -1, d).split_with_sizes((self.num_heads, self.num_kv_heads, self.num_kv_heads),
                                                               dim=1)
        else:
            qkv = qkv.view(tokens, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            # split_with_sizes: the C++ method, not Tensor.split's Python wrapper (a measurable share of a small step)
            qk, v = qkv.split_with_sizes((self.num_heads + self.num_kv_heads, self.num_kv_heads), dim=1)
            q, k = apply_rope_half(qk, cos, sin).split_with_sizes((self.num_heads, self.num_kv_heads), dim=1)
        out = attn.attend(q, k, v, kv_cache, self.scale)  # [T or len(attn.output_rows), H, D]
        return self.o_proj(out.reshape(out.shape[0], self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        lo, hi = tp.span(intermediate_size, "intermediate_size")
        keep = [(lo, hi), (intermediate_size + lo, intermediate_size + hi)]  # rows of gate and of up
        self.gate_up_proj = column_linear(hidden_size, 2 * intermediate_size, keep, bias, tp)
        self.down_proj = row_linear(intermediate_size, hidden_size, (lo, hi), bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup | None = None) -> None:
        """tp: the group to shard over; by default the current one (so an MTP head's layer shards like its target)."""
        super().__init__()
        tp = tp or current()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, getattr(config, "mlp_bias", False), tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend, kv_cache: torch.Tensor
    ) -> torch.Tensor:
        out = self.self_attn(self.input_layernorm(x), cos, sin, attn, kv_cache)
        x = keep_output_rows(x, attn) + out
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_residual(self, x: torch.Tensor, residual: torch.Tensor | None, cos, sin, attn: AttentionBackend,
                         kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer where the fused add + norm serves (`run_decoder_layers`): the previous layer's MLP output x and
        the residual before it (None at the first layer, whose x is the embedding's) -> this layer's MLP output and
        residual, their sum being `forward`'s output. Each add happens in place inside a norm's kernel."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            fused_add_rms_norm(x, residual, self.input_layernorm.weight, self.input_layernorm.eps)
        out = self.self_attn(x, cos, sin, attn, kv_cache)
        fused_add_rms_norm(out, residual, self.post_attention_layernorm.weight, self.post_attention_layernorm.eps)
        return self.mlp(out), residual


class LlamaModel(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rotary_emb = RotaryEmbedding(config, head_dim)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: LlamaConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or current()
        check_split(self.tp, {"vocab_size": config.vocab_size, "num_attention_heads": config.num_attention_heads,
                              "intermediate_size": config.intermediate_size}, config.num_key_value_heads)
        self.model = LlamaModel(config, self.tp)
        self.lm_head = lm_head_linear(config.hidden_size, config.vocab_size, self.tp)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def checkpoint_renames(key: str, tensor: torch.Tensor, config: LlamaConfig) -> list[tuple]:
        """Checkpoint tensor -> where it goes: q/k/v and gate/up land in rows of the fused parameters."""
        return [fused_rows(key, tensor, config)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        kv_caches: list[torch.Tensor],
        logits_indices: torch.Tensor | None = None,
        aux_layers: Sequence[int] = (),
    ) -> ModelOutput:
        """input_ids, positions [T] packed; attn already planned for this step's page tables."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.tables(positions, x)
        x, aux = run_decoder_layers(self.model.layers, x, cos, sin, attn, kv_caches, aux_layers)
        return ModelOutput(self.compute_logits(x, logits_indices), x, aux)

    def compute_logits(self, hidden_states: torch.Tensor, indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm + lm_head on the chosen rows of the pre-norm hidden states; fp32 logits."""
        return final_logits(self.model.norm, self.lm_head, hidden_states, indices)

    # --- KV cache -------------------------------------------------------------------------------
    def kv_cache_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        attn = self.model.layers[0].self_attn
        return (num_pages, 2, page_size, attn.num_kv_heads, attn.head_dim)

    def allocate_kv_cache(self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device) -> list:
        shape = self.kv_cache_shape(num_pages, page_size)
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in self.model.layers]

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        attn = self.model.layers[0].self_attn
        elem = torch.tensor([], dtype=dtype).element_size()
        return 2 * attn.num_kv_heads * attn.head_dim * elem * len(self.model.layers)

    def attention_dims(self) -> dict:
        """Head layout an attention backend plans with."""
        attn = self.model.layers[0].self_attn
        return dict(num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim, mla_dims=None)
