"""One kernel each for RMSNorm and SiLU-and-mul on CUDA: FlashInfer's `norm.rmsnorm` and `activation.silu_and_mul`
(fp32 accumulation, output in the input's dtype), imported on first use; elsewhere, or without FlashInfer, the torch
path, which on a GPU costs about 8 launches a norm in bf16 (issue #46).

RoPE stays on the torch path (cos/sin computed once a forward, two multiplies and an add a layer): FlashInfer's
rope kernels take positions and a cos/sin cache in the layer, which the models do not pass yet.
"""

from __future__ import annotations

import importlib.util
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
