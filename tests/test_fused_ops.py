"""The fused-kernel seam (`infer.models.fused_ops`): where FlashInfer serves a tensor, a norm and the MLP's
activation each call its one kernel with the layout it documents (rmsnorm over 2-D rows; silu_and_mul of
[gate ; up]), and give the torch path's values; elsewhere the torch path runs. FlashInfer stands in here as float64
reference kernels (no CUDA on this machine); a stand-in that reads [up ; gate] fails the check."""

from __future__ import annotations

import types

import pytest
import torch

from infer.models import fused_ops
from infer.models.common import RMSNorm
from infer.models.llama import LlamaMLP
from infer.parallel import current


def reference_kernels(swapped: bool = False) -> types.SimpleNamespace:
    calls = []

    def rmsnorm(x, weight, eps):
        assert x.dim() == 2 and weight.dtype == x.dtype
        calls.append("rmsnorm")
        x64 = x.double()
        return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * weight.double()).to(x.dtype)

    def silu_and_mul(x):
        calls.append("silu_and_mul")
        first, second = x.double().chunk(2, dim=-1)
        gate, up = (second, first) if swapped else (first, second)
        return (torch.nn.functional.silu(gate) * up).to(x.dtype)

    return types.SimpleNamespace(norm=types.SimpleNamespace(rmsnorm=rmsnorm),
                                 activation=types.SimpleNamespace(silu_and_mul=silu_and_mul), calls=calls)


@pytest.mark.parametrize("swapped", [False, True])
def test_fused_kernels_give_the_torch_paths_values(monkeypatch, swapped):
    torch.manual_seed(0)
    norm, mlp = RMSNorm(64), LlamaMLP(64, 96, False, current())
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    norm, mlp = norm.bfloat16(), mlp.bfloat16()
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = mlp(norm(x))  # CPU: the torch path
        kernels = reference_kernels(swapped)
        monkeypatch.setattr(fused_ops, "kernels_for", lambda t: kernels if t.dtype == torch.bfloat16 else None)
        got = mlp(norm(x))
    assert kernels.calls == ["rmsnorm", "silu_and_mul"]
    close = torch.allclose(got.float(), expected.float(), rtol=0.02, atol=0.02)
    assert close != swapped


def test_kernels_serve_only_half_precision_cuda_tensors():
    assert fused_ops.kernels_for(torch.zeros(2, dtype=torch.bfloat16)) is None  # a CPU tensor
    assert fused_ops.fused_rms_norm(torch.zeros(2, 4), torch.ones(4), 1e-6) is None
