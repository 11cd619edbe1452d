"""Attention over the paged KV cache, behind one interface with two backends.

A backend is planned once per step from the step's `PageMetadata` (all layers share the plan) and then
called by every layer. Two attention kinds are served:
  - `attend`:     grouped-query attention; the layer's cache is [num_pages, 2, page_size, kv_heads, head_dim]
                  (FlashInfer's NHD layout, K at index 0, V at 1).
  - `attend_mla`: DeepSeek's multi-head latent attention in its absorbed form: queries already multiplied
                  by W_UK, keys are [compressed latent ; rope key] shared by all heads, values are the latent.
                  Caches: ckv [num_pages, page_size, kv_lora_rank] and kpe [num_pages, page_size, rope_dim]
                  (FlashInfer's MLA layout).
`TorchAttention` gathers pages into padded batches and calls SDPA (CPU, tests); `FlashInferAttention` runs
FlashInfer's paged kernels (GPU), imported only when chosen.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch
import torch.nn.functional as F

from infer.kv_cache import PageMetadata


class AttentionBackend(Protocol):
    def plan(self, meta: PageMetadata) -> None: ...

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] for this step's tokens -> [T, H, D]; writes k/v into kv_cache first."""
        ...

    def attend_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q_latent [T, H, R], q_rope [T, H, Dr], ckv [T, R], kpe [T, Dr] -> latent output [T, H, R]."""
        ...


def kv_rows(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots (page * page_size + offset) -> rows of a K/V cache's flat view: [N] K rows then [N] V rows.

    A [pages, 2, page_size, ...] cache viewed flat puts K of page p at rows 2p * page_size + offset and V one
    page_size further. MLA caches ([pages, page_size, ...]) are indexed by the slots themselves.
    """
    k_rows = slots + (slots // page_size) * page_size
    return torch.cat((k_rows, k_rows + page_size))


def write_kv(kv_cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Store K/V into a [pages, 2, page_size, Hkv, D] cache; returns its flat [pages*2*page_size, Hkv, D] view."""
    flat = kv_cache.view(-1, *kv_cache.shape[-2:])
    flat.index_copy_(0, rows, torch.cat((k, v)).to(kv_cache.dtype))
    return flat


def write_mla(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Store latents or rope keys into a [pages, page_size, dim] cache; returns its flat view."""
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, rows, values.to(cache.dtype))
    return flat


class TorchAttention:
    """Paged attention in plain PyTorch: gather each sequence's pages into a padded batch, then SDPA.

    Everything that depends only on the page tables (gather indices, padding, masks) is built in `plan`,
    once per step, so each layer costs one scatter, one gather and one SDPA call.
    """

    def plan(self, meta: PageMetadata) -> None:
        device = meta.positions.device
        page_size = meta.page_size
        batch, max_q, max_kv = meta.batch_size, meta.max_q_len, meta.max_kv_len
        q_lens = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]).long()
        kv_lens = meta.kv_lens.long()

        # Caches are read and written through flat views with index_copy_/index_select (one kernel each, far
        # cheaper than multi-dimensional indexing), at token slots; K/V rows are derived from the slots on the
        # first K/V layer of the step (see kv_rows), so a model pays only for the cache layout it has.
        self.page_size = page_size
        self.write_slots = meta.slot_mapping
        self.kv_write = self.kv_read = None

        # Packed queries -> padded [B, max_q]: decode-only batches (max_q == 1) need no padding at all.
        self.decode_only = max_q == 1
        if not self.decode_only:
            q_idx = meta.qo_indptr.long()[:-1, None] + torch.arange(max_q, device=device)[None, :]
            self.q_valid = torch.arange(max_q, device=device)[None, :] < q_lens[:, None]  # [B, max_q]
            self.q_gather = q_idx.clamp_(max=meta.num_tokens - 1)

        # Prompts with nothing cached (a fresh prefill, the feature precompute): attend over this step's own
        # keys with SDPA's causal kernel; no cache read, no explicit mask.
        self.fresh_prefill = not self.decode_only and bool((q_lens == kv_lens).all())
        if self.fresh_prefill:
            return

        # Each sequence's keys, padded to max_kv (padding clamped to a valid page and masked below).
        kv_pos = torch.arange(max_kv, device=device)
        page_slot = meta.kv_indptr.long()[:-1, None] + kv_pos[None, :] // page_size
        page_slot = page_slot.clamp_(max=max(meta.kv_indices.shape[0] - 1, 0))
        self.read_slots = (meta.kv_indices.long()[page_slot] * page_size + kv_pos % page_size).flatten()  # [B*max_kv]
        self.read_shape = (batch, max_kv)

        # Causal mask: query j of sequence b sits at position kv_len - q_len + j and sees keys up to it.
        if self.decode_only and bool((kv_lens == max_kv).all()):
            self.mask = None
        else:
            q_pos = (kv_lens - q_lens)[:, None] + torch.arange(max_q, device=device)[None, :]  # [B, max_q]
            self.mask = (kv_pos[None, None, :] <= q_pos[:, :, None])[:, None]  # [B, 1, max_q, max_kv]

    def _pad_queries(self, q: torch.Tensor) -> torch.Tensor:
        """[T, H, D] packed -> [B, H, max_q, D]."""
        if self.decode_only:
            return q[:, :, None, :]
        return q[self.q_gather].transpose(1, 2)

    def _unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H, max_q, D] -> [T, H, D]."""
        if self.decode_only:
            return out[:, :, 0, :]
        return out.transpose(1, 2)[self.q_valid]

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        if self.kv_write is None:  # the step's first K/V layer
            self.kv_write = kv_rows(self.write_slots, self.page_size)
            self.kv_read = None if self.fresh_prefill else kv_rows(self.read_slots, self.page_size)
        flat = write_kv(kv_cache, self.kv_write, k, v)
        if self.fresh_prefill:
            out = F.scaled_dot_product_attention(
                self._pad_queries(q), self._pad_queries(k), self._pad_queries(v), is_causal=True, scale=scale,
                enable_gqa=True,
            )
            return self._unpad(out)
        kv = flat.index_select(0, self.kv_read).view(2, *self.read_shape, *kv_cache.shape[-2:])
        keys = kv[0].transpose(1, 2).to(q.dtype)  # [B, Hkv, max_kv, D]
        values = kv[1].transpose(1, 2).to(q.dtype)
        out = F.scaled_dot_product_attention(
            self._pad_queries(q), keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        return self._unpad(out)

    def attend_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        ckv_flat = write_mla(ckv_cache, self.write_slots, ckv)
        kpe_flat = write_mla(kpe_cache, self.write_slots, kpe)
        query = self._pad_queries(torch.cat((q_latent, q_rope), dim=-1))
        if self.fresh_prefill:
            latent = self._pad_queries(ckv[:, None, :])  # [B, 1, max_q, R]
            keys = torch.cat((latent, self._pad_queries(kpe[:, None, :])), dim=-1)
            out = F.scaled_dot_product_attention(query, keys, latent, is_causal=True, scale=scale, enable_gqa=True)
            return self._unpad(out)
        latent = ckv_flat.index_select(0, self.read_slots).view(*self.read_shape, -1).to(q_latent.dtype)  # [B, max_kv, R]
        rope_key = kpe_flat.index_select(0, self.read_slots).view(*self.read_shape, -1).to(q_latent.dtype)
        keys = torch.cat((latent, rope_key), dim=-1)[:, None]  # one head shared by all query heads
        out = F.scaled_dot_product_attention(
            query, keys, latent[:, None], attn_mask=self.mask, scale=scale, enable_gqa=True
        )
        return self._unpad(out)


class FlashInferAttention:
    """FlashInfer's paged prefill/append kernels (which also serve decode) and its MLA kernel.

    One instance per model: the plan depends on the model's head layout, given at construction.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 mla_dims: tuple[int, int] | None = None, workspace_bytes: int = 128 * 1024 * 1024) -> None:
        import flashinfer  # noqa: PLC0415 - optional GPU dependency, imported only when this backend is chosen

        self._flashinfer = flashinfer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.mla_dims = mla_dims  # (kv_lora_rank, qk_rope_head_dim) for MLA models
        workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        if mla_dims is None:
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        else:
            self.wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace)
        self._planned_scale: float | None = None
        self._meta: PageMetadata | None = None

    def plan(self, meta: PageMetadata) -> None:
        # FlashInfer bakes sm_scale into the plan; the first layer's call completes it (all layers share it).
        self._meta = meta
        self._planned_scale = None
        self.kv_write = None

    def _ensure_planned(self, scale: float) -> None:
        if self._planned_scale == scale:
            return
        meta = self._meta
        assert meta is not None, "plan() must be called before attention"
        if self.mla_dims is None:
            self.wrapper.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_last_page_len,
                self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
                causal=True, sm_scale=scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
        else:
            kv_lora_rank, rope_dim = self.mla_dims
            self.wrapper.plan(
                meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.kv_lens,
                self.num_heads, kv_lora_rank, rope_dim, meta.page_size,
                True, scale, self.dtype, self.dtype,
            )
        self._planned_scale = scale

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self._ensure_planned(scale)
        if self.kv_write is None:
            self.kv_write = kv_rows(self._meta.slot_mapping, self._meta.page_size)
        write_kv(kv_cache, self.kv_write, k, v)
        return self.wrapper.run(q.contiguous(), kv_cache)

    def attend_mla(
        self,
        q_latent: torch.Tensor,
        q_rope: torch.Tensor,
        ckv: torch.Tensor,
        kpe: torch.Tensor,
        ckv_cache: torch.Tensor,
        kpe_cache: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        self._ensure_planned(scale)
        write_mla(ckv_cache, self._meta.slot_mapping, ckv)
        write_mla(kpe_cache, self._meta.slot_mapping, kpe)
        return self.wrapper.run(q_latent.contiguous(), q_rope.contiguous(), ckv_cache, kpe_cache)


def flashinfer_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None


def resolve_backend_name(name: str, device: torch.device) -> str:
    """'auto' picks FlashInfer on CUDA when it is installed, torch otherwise."""
    if name == "auto":
        return "flashinfer" if device.type == "cuda" and flashinfer_available() else "torch"
    if name == "flashinfer" and not flashinfer_available():
        raise ValueError("attention backend 'flashinfer' needs CUDA and `pip install .[gpu]` (flashinfer-python)")
    if name not in ("torch", "flashinfer"):
        raise ValueError(f"unknown attention backend {name!r}: choose auto, torch or flashinfer")
    return name


class PackedCausalAttention:
    """Causal attention inside each of several packed sequences, with no KV cache.

    For training a head on whole sequences (gradients flow; nothing is cached): the same layer code as
    serving, so a trained head computes in `infer/` exactly the function it was trained as. Each sequence
    gets its own 4-D SDPA call with is_causal, so fused kernels (flash on CPU and GPU) apply and no
    [T, T] mask or [H, n, n] score matrix is ever built.
    """

    def __init__(self, seq_lens: list[int]) -> None:
        self.seq_lens = seq_lens

    def plan(self, meta: PageMetadata) -> None:
        raise TypeError("PackedCausalAttention has no paged plan; build it with the batch's sequence lengths")

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
