"""FlashInfer's paged kernels (GPU), imported only when this backend is chosen, and the choice of backend."""

from __future__ import annotations

import importlib.util

import torch

from infer.attention.backend import cast, write_kv, write_mla
from infer.kv_cache import PageMetadata


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
        self.output_rows = None  # every row, also where a step asks for output_rows (the others are dropped)

    def plan(self, meta: PageMetadata) -> None:
        # FlashInfer bakes sm_scale into the plan; the first layer's call completes it (all layers share it).
        self._meta = meta
        self._planned_scale = None

    def forget(self) -> None:
        """Nothing kept between forwards: each reads the pages."""

    def serves_decode_run(self, kv_lens: list[int]) -> bool:
        return True  # each step is planned on its own metadata

    def _ensure_planned(self, scale: float) -> None:
        if self._planned_scale == scale:
            return
        meta = self._meta
        assert meta is not None, "plan() must be called before attention"
        # plan() reads the indptrs and lengths on the host (given device tensors it copies them back, blocking): the
        # host copies they were built from go in; the page indices stay on the device, where run() reads them.
        host = meta.on_host()
        if self.mla_dims is None:
            self.wrapper.plan(
                host.qo_indptr, host.kv_indptr, meta.kv_indices, host.kv_last_page_len,
                self.num_heads, self.num_kv_heads, self.head_dim, meta.page_size,
                causal=True, sm_scale=scale, q_data_type=self.dtype, kv_data_type=self.dtype,
            )
        else:
            kv_lora_rank, rope_dim = self.mla_dims
            self.wrapper.plan(
                host.qo_indptr, host.kv_indptr, meta.kv_indices, host.kv_lens,
                self.num_heads, kv_lora_rank, rope_dim, meta.page_size,
                True, scale, self.dtype, self.dtype,
            )
        self._planned_scale = scale

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        self._ensure_planned(scale)
        write_kv(kv_cache, self._meta.cache_rows, cast(torch.cat((k, v)), kv_cache.dtype))
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
