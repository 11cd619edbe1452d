"""Training-time test (TTT): the unrolled head attends as the runtime's drafter does.

Serving (infer.speculative): the drafter's cache holds, for the accepted prefix 0..j, keys computed from the
target's features (catch-up: "step 0"); the chain drafted from position j then writes its own keys at positions
j+1, j+2, ... So at unroll step k the head's query at anchor j (rope position j + k) attends to

    the step-0 keys of anchors 0..j           (causal over the target's features)
    its own keys of steps 1..k at anchor j    (the drafted chain, one key per step)

on every record of a packed batch. `ChainAttention` implements infer's attention interface (attend, attend_mla) for
the head's one layer with exactly that pattern, so training runs infer's own layer code.

How, without an [L, L] mask: one SDPA call per record and step, is_causal, no mask at all. The chain's k keys per
query differ from query to query, so they cannot be plain keys; instead each query gets k extra coordinates holding
its (unscaled) scores against its own chain keys d_{j,c} = q_j . K_c[j], and the key set is prefixed with k
"indicator" keys e_c whose scores are therefore exactly d_{j,c}, and whose values are e_c in k extra value
coordinates. With k dummy queries prepended, query j sees (top-left causal) the k indicators and the step-0 keys
0..j, one softmax over all of them; the value's extra coordinates return the attention weight w_{j,c} each chain
key gets, and the output is out_j + sum_c w_{j,c} V_c[j]. It is exact (the same softmax), differentiable end to
end, and costs O(L (D + k)) memory per head on top of SDPA's own.

With `loss.chain_share` below 1 a later step runs over a window of anchors that may start past anchor 0: its queries
sit at the bottom right of their keys (query first + i sees keys 0..first + i), a causal alignment SDPA takes as a
`causal_lower_right` bias (on a CPU a boolean mask of the window's rows by its keys; GPU kernels take it as is).

Read, for the pattern (not the code): SpecForge's llama3_eagle.py (sgl-project/SpecForge @ 89241ea0299e4ac48a22d2
7d649182627d0e5e53, specforge/modeling/draft/llama3_eagle.py, LlamaAttention.forward with cache_hidden: [L, L]
causal scores over cache_k[0] with an additive mask, then one diagonal score (q * k_i).sum(-1) per later step,
one softmax) and its flex mask (specforge/modeling/draft/flex_attention.py @ 1ed2fec85b18a06d6c4968f8ae001013d4a
450a3, generate_eagle3_mask: causal block or (kv_idx - q_idx) % Q_LEN == 0). SpecForge keeps every step's rope
position at j; here step k's query sits at j + k, where the runtime's drafter puts it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

PAD_DIM = 16  # head dims padded to a multiple of this: zeros change nothing, and fused kernels run their fast paths
# (GPU kernels want multiples of 8; CPU flash at 16 against stories260K's 8: docs/benchmark_history.md)


def chain_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, chain_k: torch.Tensor, chain_v: torch.Tensor,
                    scale: float, first: int = 0) -> torch.Tensor:
    """One run of anchors of a record at one unroll step.

    q [H, n, Dk] the step's queries at anchors first..first+n-1; k0 [Hkv, n0, Dk], v0 [Hkv, n0, Dv] the step-0 keys
    and values of anchors 0..n0-1 (first + n <= n0); chain_k [s, Hkv, n, Dk], chain_v [s, Hkv, n, Dv] the keys and
    values steps 1..s (this one included) wrote at the query anchors. Returns [H, n, Dv]; s = 0 is plain causal
    attention (first = 0, n = n0). A run that starts past anchor 0 (`loss.chain_share`'s windows) sees every earlier
    anchor's key: causal aligned at the bottom right, a mask SDPA builds for it.
    """
    s = chain_k.shape[0]
    if s == 0:
        dv = v0.shape[-1]
        pad_k, pad_v = -q.shape[-1] % PAD_DIM, -dv % PAD_DIM
        out = F.scaled_dot_product_attention(F.pad(q, (0, pad_k))[None], F.pad(k0, (0, pad_k))[None],
                                             F.pad(v0, (0, pad_v))[None], is_causal=True, scale=scale,
                                             enable_gqa=True)[0]
        return out[..., :dv]
    heads, n, dk = q.shape
    kv_heads, n0, dv = v0.shape
    group = heads // kv_heads
    ck = chain_k.repeat_interleave(group, dim=1)  # [s, H, n, Dk]
    cv = chain_v.repeat_interleave(group, dim=1)  # [s, H, n, Dv]
    scores = (q[None] * ck).sum(-1).permute(1, 2, 0)  # [H, n, s] q_j . K_c[j], unscaled: SDPA scales
    pad_k, pad_v = -(dk + s) % PAD_DIM, -(dv + s) % PAD_DIM
    queries = F.pad(torch.cat((q, scores), dim=-1), (0, pad_k, s, 0))  # [H, s + n, Dk + s + pad]: s dummy rows first
    if first:  # the keys up to the last query's anchor: query row s + i then sees keys up to s + first + i
        k0, v0 = k0[:, : first + n], v0[:, : first + n]
    eye = torch.eye(s, dtype=q.dtype, device=q.device).expand(kv_heads, s, s)
    keys = F.pad(torch.cat((torch.cat((k0.new_zeros(kv_heads, s, dk), eye), -1),
                            F.pad(k0, (0, s))), dim=1), (0, pad_k))  # [Hkv, s + n0, Dk + s + pad]
    values = F.pad(torch.cat((torch.cat((v0.new_zeros(kv_heads, s, dv), eye), -1),
                              F.pad(v0, (0, s))), dim=1), (0, pad_v))  # [Hkv, s + n0, Dv + s + pad]
    causal = {"attn_mask": causal_lower_right(s + n, keys.shape[1])} if first else {"is_causal": True}
    out = F.scaled_dot_product_attention(queries[None], keys[None], values[None], scale=scale, enable_gqa=True,
                                         **causal)[0, :, s:]  # [H, n, Dv + s + pad]
    weights = out[..., dv : dv + s]  # [H, n, s] the softmax weight of each chain key
    return out[..., :dv] + torch.einsum("hnc,chnd->hnd", weights, cv)


class ChainAttention:
    """infer's attention interface over the unroll of one packed batch (module docstring); no KV cache.

    Call `begin_step(records, seq_lens, starts)` before each unroll step: its runs of consecutive anchors (the step's
    rows, `mtp_train.unroll.UnrollStep`), each run's record (index into the batch), length and first anchor. Step 0 runs
    over whole records; a later step's runs keep their first anchor and lose anchors from their end only. One
    attention layer per head.
    Attention runs in `dtype` (the training dtype) even under the trainer's bf16 autocast (`trainer.autocast`):
    on CPU, bf16 SDPA is slower than fp32, unlike the head's matmuls (docs/benchmark_history.md).
    """

    output_rows = None  # every row

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.step = -1
        self.records: list[int] = []
        self.seq_lens: list[int] = []
        self.starts: list[int] = []
        self.k0: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # record -> step-0 ([Hkv, n0, Dk], [Hkv, n0, Dv])
        # (record, first anchor) -> steps 1.. (k, v) of that run
        self.chain: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def begin_step(self, records: list[int], seq_lens: list[int], starts: list[int]) -> None:
        self.step += 1
        self.records, self.seq_lens, self.starts = records, seq_lens, starts

    def plan(self, meta) -> None:
        raise TypeError("ChainAttention has no paged plan: it serves the trainer's unroll")

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv] packed by record -> [T, H, Dv] in self.dtype."""
        with torch.autocast(q.device.type, enabled=False):
            return self._attend_records(q.to(self.dtype), k.to(self.dtype), v.to(self.dtype), scale)

    def _attend_records(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        outs = []
        for record, first, q_r, k_r, v_r in zip(self.records, self.starts, q.split(self.seq_lens),
                                                k.split(self.seq_lens), v.split(self.seq_lens)):
            q_r, k_r, v_r = q_r.transpose(0, 1), k_r.transpose(0, 1), v_r.transpose(0, 1)  # [heads, n, D]
            n = q_r.shape[1]
            if self.step == 0:
                self.k0[record] = (k_r, v_r)
            else:
                self.chain.setdefault((record, first), []).append((k_r, v_r))
            k0, v0 = self.k0[record]
            steps = self.chain.get((record, first), [])
            chain_k = torch.stack([c[0][:, :n] for c in steps]) if steps else k0.new_zeros(0, *k0.shape)
            chain_v = torch.stack([c[1][:, :n] for c in steps]) if steps else v0.new_zeros(0, *v0.shape)
            outs.append(chain_attention(q_r, k0, v0, chain_k, chain_v, scale, first).transpose(0, 1))
        return torch.cat(outs)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: None, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for this step's positions -> [T, H, D]; there is no cache."""
        return self._attend(q, k, v, scale)

    def attend_mla(self, q_latent: torch.Tensor, q_rope: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                   ckv_cache: None, kpe_cache: None, scale: float) -> torch.Tensor:
        """Absorbed MLA: keys [latent ; rope key] and values (the latent) are one head shared by all query heads."""
        keys = torch.cat((ckv, kpe), dim=-1)[:, None]  # [T, 1, R + Dr]
        return self._attend(torch.cat((q_latent, q_rope), dim=-1), keys, ckv[:, None], scale)
