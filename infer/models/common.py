"""Pieces every architecture shares: RMSNorm, rotary embeddings, the forward's output, KV-cache sizing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from infer.attention import cast
from infer.models.fused_ops import FusedRope, fused_rms_norm, serves


@dataclass
class ModelOutput:
    """What one packed forward returns.

    logits:            [N, vocab] for the rows picked by `logits_indices` (all T tokens when None), fp32
    hidden_states:     [T, hidden] the last decoder layer's output, before the final norm (what MTP heads eat)
    aux_hidden_states: decoder-layer index -> [T, hidden] that layer's output (EAGLE-3-style features)
    """

    logits: torch.Tensor | None
    hidden_states: torch.Tensor
    aux_hidden_states: dict[int, torch.Tensor] = field(default_factory=dict)


def keep_output_rows(x: torch.Tensor, attn) -> torch.Tensor:
    """A layer's residual [T, H] -> the rows its attention computed outputs for (`AttentionBackend.output_rows`)."""
    return x if attn.output_rows is None else x.index_select(0, attn.output_rows)


def run_decoder_layers(
    layers: nn.ModuleList, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn, kv_caches: list,
    aux_layers: Sequence[int] = (),
) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The decoder stack over a packed batch: the last layer's output and the outputs of `aux_layers`."""
    if attn.output_rows is not None:
        raise ValueError("a step with output_rows serves one-layer heads: a decoder stack needs every row's output")
    aux: dict[int, torch.Tensor] = {}
    if serves(x) and hasattr(layers[0], "forward_residual"):
        return _run_residual_stream(layers, x, cos, sin, attn, kv_caches, aux_layers)
    for i, layer in enumerate(layers):
        x = layer(x, cos, sin, attn, kv_caches[i])
        if i in aux_layers:
            aux[i] = x
    return x, aux


def _run_residual_stream(layers: nn.ModuleList, x: torch.Tensor, cos, sin, attn, kv_caches: list,
                         aux_layers: Sequence[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The stack as vLLM and SGLang run it where the fused add + norm serves: each layer gets (its last sublayer's
    output, the residual so far) and adds them in place inside its input norm's kernel, so a layer's output x +
    residual is only made where it is read (aux layers, the last). The stack owns the residual (the embedding's
    output, then the sums): nothing another holds is written."""
    aux: dict[int, torch.Tensor] = {}
    residual = None
    for i, layer in enumerate(layers):
        x, residual = layer.forward_residual(x, residual, cos, sin, attn, kv_caches[i])
        if i in aux_layers:
            aux[i] = x + residual
    return aux[len(layers) - 1] if len(layers) - 1 in aux else x + residual, aux


def final_logits(norm: nn.Module, lm_head: nn.Module, hidden_states: torch.Tensor,
                 indices: torch.Tensor | None = None) -> torch.Tensor:
    """Final norm + lm_head on the chosen rows of pre-norm hidden states; fp32 logits.

    The normed states are cast to lm_head's dtype: a head may run in another precision than the target's lm_head.
    """
    if indices is not None:
        hidden_states = hidden_states[indices]
    return cast(lm_head(cast(norm(hidden_states), lm_head.weight.dtype)), torch.float32)


SMALL_NORM_ELEMENTS = 2048  # fp32 CPU inputs up to this many elements are normalised by `rms_norm_small`


def rms_norm_small(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a small fp32 CPU input through one fused kernel: the layer norm of [x, -x] is the RMSNorm of x
    (its mean is 0, its variance mean(x^2)). Torch's CPU rms_norm is a composite of six ops, so small rows pay
    dispatch; past about 50 rows of 64 the concatenation costs more than it saves (docs/benchmark_history.md)."""
    h = x.shape[-1]
    return torch.layer_norm(torch.cat((x, x.neg()), -1), (2 * h,), None, None, eps).narrow(-1, 0, h).mul(weight)


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back, exactly as the Hugging Face Llama/DeepSeek files do."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # one fused call; the same arithmetic as below
            if x.device.type == "cpu" and x.numel() <= SMALL_NORM_ELEMENTS:
                return rms_norm_small(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        fused = fused_rms_norm(x, self.weight, self.eps)  # one kernel on CUDA (FlashInfer), else None
        if fused is not None:
            return fused
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: PretrainedConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the cos/sin scale for any rope_type transformers knows (llama3, yarn, ...).

    Using transformers' own functions keeps scaled-RoPE variants in lockstep with the reference models.
    """
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)), 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {rope_type!r} in the model config")
    with torch.device("cpu"):  # some init functions (yarn) create tensors without a device: not on meta
        inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
    return inv_freq.float(), float(scale)


ROPE_TABLE_MARGIN = 256


class RotaryEmbedding(nn.Module):
    """cos/sin for a step's positions, computed once per forward and shared by all layers.

    The frequencies are always built on the CPU (even when the model is built on the meta device for
    loading), so they are real numbers that `.to(device)` moves.
    """

    def __init__(self, config: PretrainedConfig, dim: int) -> None:
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(config, dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        signs = torch.ones(dim, device="cpu")
        signs[: dim // 2] = -1.0
        self.register_buffer("half_signs", signs, persistent=False)  # [-1 ... -1, 1 ... 1]: the signed sin
        # the one-kernel RoPE's table rows: the context, and a margin for drafts past its end (a GPU kernel reading
        # past the table would not fail, it would read garbage)
        self.max_positions = (getattr(config, "max_position_embeddings", None) or 4096) + ROPE_TABLE_MARGIN
        self._cos_sin_cache: torch.Tensor | None = None  # the one-kernel RoPE's table (`cos_sin_cache`)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim // 2] in fp32 (the interleaved layout's tables)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos() * self.scale, freqs.sin() * self.scale

    def tables(self, positions: torch.Tensor, x: torch.Tensor) -> tuple:
        """What a forward's layers rotate with: a `FusedRope` (and None) where the one-kernel RoPE serves x (the
        forward's hidden states: CUDA half precision with FlashInfer), else `half_split`'s cos and signed sin."""
        if not serves(x):
            return self.half_split(positions)
        return FusedRope(positions, self.cos_sin_cache()), None

    def cos_sin_cache(self) -> torch.Tensor:
        """[max positions, dim] fp32: cos then sin of every position's frequencies (the values of `forward`), made
        once on the frequencies' device (a forward's warm-up, never a capture)."""
        if self._cos_sin_cache is None:
            positions = torch.arange(self.max_positions, device=self.inv_freq.device, dtype=torch.float)
            freqs = positions[:, None] * self.inv_freq[None, :]
            self._cos_sin_cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1) * self.scale
        return self._cos_sin_cache

    def half_split(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, signed sin [T, 1, dim] in fp32 for `apply_rope_half`: [cos ; cos] and [-sin ; sin],
        the values of `forward` laid out for the half-split pairs in fewer ops (once per step, used by every layer)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        both = torch.cat((freqs, freqs), dim=-1)
        cos, sin = both.cos(), both.sin() * self.half_signs
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos[:, None, :], sin[:, None, :]


def apply_rope_half(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in the half-split layout (Llama: pairs (i, i + D/2)), tables from RotaryEmbedding.half_split."""
    if x.dtype != torch.float32:  # rotated in fp32, as transformers does
        return apply_rope_half(x.float(), cos, signed_sin).to(x.dtype)
    return torch.addcmul(x * cos, torch.roll(x, x.shape[-1] // 2, dims=-1), signed_sin)  # x cos + [x2 ; x1] sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in the interleaved layout (DeepSeek): pairs are (2i, 2i + 1)."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2).to(x.dtype)
