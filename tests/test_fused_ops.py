"""The fused-kernel seam (`infer.models.fused_ops`): where FlashInfer serves a tensor, a norm and the MLP's
activation each call its one kernel with the layout it documents (rmsnorm over 2-D rows; silu_and_mul of
[gate ; up]), and give the torch path's values; elsewhere the torch path runs. A Llama forward where they serve
rotates q and k with one RoPE kernel a layer and adds each residual inside a norm's kernel (the residual stream), with
the torch path's logits, hidden states and aux states, and traces whole under torch.compile(fullgraph=True).
FlashInfer stands in here as float64 reference kernels (no CUDA on this machine); stand-ins that read [up ; gate],
rotate interleaved pairs or leave the residual unwritten fail."""

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


def stand_in_kernels(broken: str = "") -> types.SimpleNamespace:
    """The reference kernels plus float64 stand-ins for the in-place add + norm and the cos/sin-cache RoPE, with
    FlashInfer's documented semantics; broken: "interleaved" rotates (2i, 2i + 1) pairs, "residual" leaves the
    residual unwritten (the two mistakes the wiring could make)."""
    kernels = reference_kernels()

    def fused_add_rmsnorm(x, residual, weight, eps):
        assert x.shape == residual.shape and x.dim() == 2 and weight.dtype == x.dtype
        kernels.calls.append("fused_add_rmsnorm")
        total = x.double() + residual.double()
        if broken != "residual":
            residual.copy_(total)
        x.copy_(total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * weight.double())

    def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True):
        assert is_neox and cos_sin_cache.dtype == torch.float32 and query.dim() == key.dim() == 2
        kernels.calls.append("rope")
        cos, sin = cos_sin_cache[positions].double()[:, None].chunk(2, dim=-1)  # [T, 1, D/2] each
        for t in (query, key):
            heads = t.view(t.shape[0], -1, head_size)  # a view of the projection's columns: written in place
            if broken == "interleaved":
                x1, x2 = heads.double()[..., 0::2], heads.double()[..., 1::2]
            else:
                x1, x2 = heads.double().chunk(2, dim=-1)
            heads.copy_(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1))

    kernels.norm.fused_add_rmsnorm = fused_add_rmsnorm
    kernels.rope = types.SimpleNamespace(apply_rope_with_cos_sin_cache_inplace=apply_rope_with_cos_sin_cache_inplace)
    return kernels


@pytest.mark.parametrize("broken", ["", "interleaved", "residual"])
def test_fused_add_norm_and_rope_give_the_torch_paths_values(monkeypatch, broken):
    """A bf16 Llama's forward with the kernels standing in where they serve: per layer one RoPE kernel, each residual
    add inside a norm's kernel (2L - 1 of them; the first layer's input norm and the final norm alone), the logits,
    the last hidden states and an aux layer's states those of the torch path (the residual stream leaves what it
    returns unwritten); either broken stand-in changes them."""
    from infer.attention import PackedCausalAttention
    from infer.bench.graph_check import random_model

    shape = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=64, rope_theta=500.0)
    model = random_model(shape, "cpu")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.mul_(10)  # N(0, 0.2): layers that change the states visibly
    ids, positions = torch.tensor([5, 9, 17, 33, 60, 7, 8, 100]), torch.tensor([3, 4, 5, 6, 7, 0, 1, 2])

    def forward():
        with torch.no_grad():
            return model(ids, positions, PackedCausalAttention([5, 3]), [None] * 3, None, aux_layers=(0,))

    expected = forward()  # CPU: the torch path
    kernels = stand_in_kernels(broken)
    monkeypatch.setattr(fused_ops, "kernels_for", lambda t: kernels if t.dtype == torch.bfloat16 else None)
    got = forward()
    assert kernels.calls.count("rope") == 3 and kernels.calls.count("fused_add_rmsnorm") == 5
    assert kernels.calls.count("rmsnorm") == 2 and kernels.calls.count("silu_and_mul") == 3

    def error(a, b):
        return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()

    errors = [error(got.logits, expected.logits), error(got.hidden_states, expected.hidden_states),
              error(got.aux_hidden_states[0], expected.aux_hidden_states[0])]
    assert (max(errors) < 0.1) == (broken == ""), errors  # bf16 rounding: about 0.03; broken: over 0.5
    if broken == "":  # what a graph captures of it: traced whole (no host read, no data-dependent shape)
        torch._dynamo.reset()
        compiled = torch.compile(forward, fullgraph=True, backend="eager")()
        torch.testing.assert_close(compiled.logits, got.logits, rtol=0, atol=0)
