"""What every attention backend offers the model layers (`AttentionBackend`), and the helpers that read and write
the paged K/V caches' flat views."""

from __future__ import annotations

from typing import Protocol

import torch

from infer.kv_cache import PageMetadata


class AttentionBackend(Protocol):
    # The rows of the packed batch whose outputs attend returns (None: all); a layer keeps those rows of its residual
    # (`infer.models.common.keep_output_rows`). Set by plan: the step's `PageMetadata.output_rows`, where the backend
    # computes those rows alone.
    output_rows: torch.Tensor | None

    def plan(self, meta: PageMetadata) -> None: ...

    def forget(self) -> None:
        """Drop what it keeps between forwards: a forward it did not run (a CUDA graph's) wrote K/V since."""
        ...

    def serves_decode_run(self, kv_lens: list[int]) -> bool:
        """Whether a decode run (`DecodeSteps`, planned once on its first step) over sequences of these kv lengths
        is attended as this backend would attend each of its steps alone."""
        ...

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
    """Token slots [..., N] (page * page_size + offset) -> rows of a K/V cache's flat view [..., 2N]: K rows, then
    V rows (the keys a group reads; the new tokens' rows come listed in `PageMetadata.cache_rows`).

    A [pages, 2, page_size, ...] cache viewed flat puts K of page p at rows 2p * page_size + offset and V one
    page_size further. MLA caches ([pages, page_size, ...]) are indexed by the slots themselves.
    """
    k_rows = slots + (slots // page_size) * page_size
    return torch.cat((k_rows, k_rows + page_size), dim=-1)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; x itself when it is already, without `Tensor.to`'s dispatch (a small model's forward is op
    dispatch; see docs/benchmark_history.md)."""
    return x if x.dtype == dtype else x.to(dtype)


def write_kv(kv_cache: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Store kv = cat(K, V) [2T, Hkv, D] into a [pages, 2, page_size, Hkv, D] cache at `rows` (kv_rows); returns its
    flat [pages*2*page_size, Hkv, D] view."""
    flat = kv_cache.view(-1, *kv_cache.shape[-2:])
    flat.index_copy_(0, rows, kv)
    return flat


def write_kv_rows(kv_cache: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> torch.Tensor:
    """Store K and V [T, Hkv, D] at their own rows of a [pages, 2, page_size, Hkv, D] cache's flat view (a graph's
    static row buffers: no concatenation); returns the flat view."""
    flat = kv_cache.view(-1, *kv_cache.shape[-2:])
    flat.index_copy_(0, k_rows, cast(k, flat.dtype))
    flat.index_copy_(0, v_rows, cast(v, flat.dtype))
    return flat


def write_mla(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Store latents or rope keys into a [pages, page_size, dim] cache; returns its flat view."""
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, rows, values.to(cache.dtype))
    return flat
