"""Causal attention over packed whole sequences with no cache: training a head with the serving layers' code."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.kv_cache import PageMetadata


class PackedCausalAttention:
    """Causal attention inside each of several packed sequences, with no KV cache.

    For training a head on whole sequences (gradients flow; nothing is cached): the same layer code as
    serving, so a trained head computes in `infer/` exactly the function it was trained as. Each sequence
    gets its own 4-D SDPA call with is_causal, so fused kernels (flash on CPU and GPU) apply and no
    [T, T] mask or [H, n, n] score matrix is ever built.
    """

    output_rows = None  # every row

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def plan(self, meta: PageMetadata) -> None:
        raise TypeError("PackedCausalAttention has no paged plan; build it with the batch's sequence lengths")

    def serves_decode_run(self, kv_lens: list[int]) -> bool:
        return False  # no paged plan

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | None, scale: float
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] packed -> [T, H, D]; kv_cache is ignored."""
        outs = []
        for q_seq, k_seq, v_seq in zip(q.split(self.seq_lens), k.split(self.seq_lens), v.split(self.seq_lens)):
            out = F.scaled_dot_product_attention(
                q_seq.transpose(0, 1)[None], k_seq.transpose(0, 1)[None], v_seq.transpose(0, 1)[None],
                is_causal=True, scale=scale, enable_gqa=True,
            )
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)

    def attend_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        ckv_cache: torch.Tensor | None,
        kpe_cache: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA: keys [latent ; rope key] and values (the latent) are one head shared by all query heads."""
        outs = []
        for q_lat, q_rot, latent, rope_key in zip(
            q_latent.split(self.seq_lens), q_rope.split(self.seq_lens), ckv.split(self.seq_lens), kpe.split(self.seq_lens)
        ):
            query = torch.cat((q_lat, q_rot), dim=-1).transpose(0, 1)[None]  # [1, H, n, R + Dr]
            keys = torch.cat((latent, rope_key), dim=-1)[None, None]  # [1, 1, n, R + Dr]
            out = F.scaled_dot_product_attention(query, keys, latent[None, None], is_causal=True, scale=scale,
                                                 enable_gqa=True)
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs)
