"""FlashInfer's paged kernels inside CUDA graphs (`infer.cuda_graphs` with the FlashInfer backend).

A captured kernel reads its metadata from fixed addresses, so every captured padded batch size (and rows a request)
gets its own wrapper built with `use_cuda_graph=True` over views of fixed buffers sized for the largest batch and
context: qo_indptr [bs + 1], kv_indptr [bs + 1], kv_last_page_len [bs] and one shared kv_indices buffer. One row a
request (decode, a head's drafts) takes `BatchDecodeWithPagedKVCacheWrapper`; K+1 rows (verify, a head's catch-up)
`BatchPrefillWithPagedKVCacheWrapper` with a causal mask. `plan()` runs on the host before every replay, from
host copies of the step's padded metadata, and writes those buffers (FlashInfer decode.py / prefill.py, "cudagraph
mode"); it never runs inside a capture, where its host work would not be recorded.
Modelled on SGLang's FlashInfer backend (sgl-project/sglang 0005834, python/sglang/srt/layers/attention/
flashinfer_backend.py: `decode_cuda_graph_metadata[bs]` / `prefill_cuda_graph_metadata[bs]` wrappers over
`kv_indptr[:bs + 1]` views of shared buffers, planned again in `init_forward_metadata_replay_cuda_graph`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.attention.backend import write_kv_rows
from infer.device_copy import pinned

# SGLang's `should_use_tensor_core`: decode through the prefill (tensor-core) kernels from this query-head group
TENSOR_CORE_MIN_GROUP = 4


@dataclass(frozen=True)
class PaddedPlan:
    """A padded forward's page metadata on the host (int32), in FlashInfer's layout: what `plan()` reads."""

    batch: int
    q_len: int
    qo_indptr: torch.Tensor  # [batch + 1]
    kv_indptr: torch.Tensor  # [batch + 1]
    kv_indices: torch.Tensor  # [kv_indptr[-1]]
    kv_last_page_len: torch.Tensor  # [batch]


def padded_plan(host, batch: int, q_len: int, dummy_page: int) -> PaddedPlan:
    """The plan of a forward of `host` (a step's `PageMetadata` on the host, uniform q_len rows a request) padded to
    `batch` requests: each padded request holds q_len rows on the dummy page alone."""
    real, pad = host.batch_size, batch - host.batch_size
    used = int(host.kv_indptr[real])
    int32 = dict(dtype=torch.int32)
    return PaddedPlan(
        batch, q_len,
        torch.arange(0, (batch + 1) * q_len, q_len, **int32),
        torch.cat((host.kv_indptr[: real + 1].int(), used + torch.arange(1, pad + 1, **int32))),
        torch.cat((host.kv_indices[:used].int(), torch.full((pad,), dummy_page, **int32))),
        torch.cat((host.kv_last_page_len[:real].int(), torch.full((pad,), q_len, **int32))),
    )


class FlashInferGraphAttention:
    """The attention a captured forward calls on the FlashInfer backend: `plan` (host, before each replay), then
    `bind` (which wrapper and which static K/V rows; Python only, so a capture records nothing of it) and each
    layer's `attend` (the K/V write and the wrapper's run: device work a graph holds)."""

    output_rows = None  # every row's output is computed

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 page_size: int, max_batch: int, max_pages: int, mla_dims: tuple | None = None,
                 workspace_bytes: int = 128 * 1024 * 1024) -> None:
        import flashinfer  # noqa: PLC0415 - optional GPU dependency, imported only when this backend is chosen

        if mla_dims is not None:
            raise ValueError("MLA models run eagerly: FlashInfer's graph wrappers here serve GQA models only")
        self._flashinfer = flashinfer
        self.dims = (num_heads, num_kv_heads, head_dim)
        self.dtype, self.device, self.page_size = dtype, device, page_size
        self.use_tensor_cores = num_heads // num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=device)  # shared: replays are serial
        new = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
        self.qo_indptr, self.kv_indptr = new(max_batch + 1), new(max_batch + 1)
        self.kv_indices, self.kv_last_page_len = new(max_batch * max_pages), new(max_batch)
        self.wrappers: dict[tuple[int, int], object] = {}
        self.scale: float | None = None  # sm_scale, learnt from the first layer that attends (all layers share it)
        self._pending: PaddedPlan | None = None  # a plan waiting for the scale (the first forward only)
        self.num_plans = 0

    def wrapper(self, batch: int, q_len: int):
        """The graph wrapper of `batch` padded requests of q_len rows, built on first use over the fixed buffers."""
        held = self.wrappers.get((batch, q_len))
        if held is None:
            fi, views = self._flashinfer, (self.kv_indptr[: batch + 1], self.kv_indices, self.kv_last_page_len[:batch])
            if q_len == 1:
                held = fi.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                    paged_kv_indptr_buffer=views[0], paged_kv_indices_buffer=views[1],
                    paged_kv_last_page_len_buffer=views[2])
            else:
                held = fi.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=self.qo_indptr[: batch + 1],
                    paged_kv_indptr_buf=views[0], paged_kv_indices_buf=views[1], paged_kv_last_page_len_buf=views[2])
            self.wrappers[(batch, q_len)] = held
        return held

    def plan(self, plan: PaddedPlan) -> None:
        """Plan the forward's wrapper now (host work before a replay); before the first forward has told the scale,
        at that forward's first layer (a warm-up run, never a capture)."""
        self._pending = plan
        if self.scale is not None:
            self._plan(self.scale)

    def _plan(self, scale: float) -> None:
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FlashInfer plan() inside a CUDA graph capture: plan before the capture and each replay")
        plan, self._pending = self._pending, None
        heads, kv_heads, head_dim = self.dims
        used = plan.kv_indices.shape[0]
        # the page ids go into the fixed buffer here, asynchronously (FlashInfer copies host indices blocking), and
        # the wrapper is handed that buffer's view: its own copy is then device to device
        self.kv_indices[:used].copy_(pinned(plan.kv_indices, self.device), non_blocking=True)
        indptr, last = pinned(plan.kv_indptr, self.device), pinned(plan.kv_last_page_len, self.device)
        wrapper = self.wrapper(plan.batch, plan.q_len)
        common = dict(sm_scale=scale, q_data_type=self.dtype, kv_data_type=self.dtype)
        if plan.q_len == 1:
            wrapper.plan(indptr, self.kv_indices[:used], last, heads, kv_heads, head_dim, self.page_size, **common)
        else:
            wrapper.plan(pinned(plan.qo_indptr, self.device), indptr, self.kv_indices[:used], last, heads, kv_heads,
                         head_dim, self.page_size, causal=True, **common)
        self.num_plans += 1

    def bind(self, batch: int, q_len: int, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """The wrapper of this graph's shape and the static cache rows its tokens' K and V go to."""
        self.active, self.k_rows, self.v_rows = self.wrapper(batch, q_len), k_rows, v_rows

    def prepare(self) -> None:
        """Nothing on the device: the plan holds the forward's metadata."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; k/v go into kv_cache first (padded rows: the dummy page)."""
        if self._pending is not None:
            self.scale = scale
            self._plan(scale)
        elif scale != self.scale:
            raise ValueError(f"layers attend with sm_scale {scale} and {self.scale}: one plan serves one scale")
        write_kv_rows(kv_cache, self.k_rows, self.v_rows, k, v)
        return self.active.run(q.contiguous(), kv_cache)

    def attend_mla(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("MLA models run eagerly: the graph runner serves GQA models only")
