"""One kernel each on CUDA half precision through FlashInfer, imported on first use: RMSNorm (`norm.rmsnorm`), the
residual add + RMSNorm in place (`norm.fused_add_rmsnorm`), SiLU-and-mul (`activation.silu_and_mul`) and RoPE on q and k
in place (`rope.apply_rope_with_cos_sin_cache_inplace`, from positions and a cos/sin cache), each with fp32
accumulation and output in the input's dtype. Elsewhere, or without FlashInfer, the torch path, which on a GPU costs
about 8 launches a norm in bf16 and 6 a rotation (issue #46).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

FUSED_DTYPES = (torch.float16, torch.bfloat16)  # what FlashInfer's norm and activation kernels take
_flashinfer: ModuleType | None | bool = False  # False: not looked up yet


def kernels_for(x: torch.Tensor) -> ModuleType | None:
    """The FlashInfer module where x is a half-precision CUDA tensor and FlashInfer is installed, else None."""
    global _flashinfer
    if x.device.type != "cuda" or x.dtype not in FUSED_DTYPES:
        return None
    if _flashinfer is False:
        _flashinfer = None
        if importlib.util.find_spec("flashinfer") is not None:
            import flashinfer  # noqa: PLC0415 - optional GPU dependency

            _flashinfer = flashinfer
    return _flashinfer


def serves(x: torch.Tensor) -> bool:
    """Whether the one-kernel path serves a forward whose hidden states are x."""
    return kernels_for(x) is not None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x [..., H] in one kernel, or None where no fused kernel serves it (the caller's torch path)."""
    kernels = kernels_for(x)
    if kernels is None:
        return None
    shape = x.shape
    return kernels.norm.rmsnorm(x.reshape(-1, shape[-1]), weight.to(x.dtype), eps).view(shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of x = [gate ; up] [..., 2I] -> [..., I]: one kernel on CUDA, three ops elsewhere."""
    kernels = kernels_for(x)
    if kernels is not None:
        return kernels.activation.silu_and_mul(x)
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """residual += x, then x = RMSNorm(residual), both in place in one kernel (x, residual [T, H]); False where no
    fused kernel serves x (the caller's torch path)."""
    kernels = kernels_for(x)
    if kernels is None:
        return False
    kernels.norm.fused_add_rmsnorm(x, residual, weight.to(x.dtype), eps)
    return True


@dataclass(frozen=True)
class FusedRope:
    """A forward's rotary inputs for the one-kernel RoPE: positions [T] and an fp32 cos/sin cache [positions, dim]
    (cos of each frequency, then its sin: the half-split "neox" layout, scale included)."""

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor


def fused_rope(qkv: torch.Tensor, q_cols: int, k_cols: int, head_dim: int, rope: FusedRope) -> None:
    """Rotate in place the q and k columns of a fused projection's output qkv [T, q_cols + k_cols + ...] (heads of
    head_dim), one kernel for both; the caller has checked that kernels_for(qkv) serves it."""
    query, key = qkv[:, :q_cols], qkv[:, q_cols : q_cols + k_cols]
    kernels_for(qkv).rope.apply_rope_with_cos_sin_cache_inplace(rope.positions, query, key, head_dim,
                                                                rope.cos_sin_cache, is_neox=True)
