"""A stand-in for the `flashinfer` package on machines without CUDA: the two wrappers `infer.attention`'s FlashInfer
backend drives, computed from nothing but what plan() was given, in FlashInfer's documented layout
(docs.flashinfer.ai, "KV-Cache Layout"; flashinfer/prefill.py and mla.py at fb28d72):

  - sequence b's queries are rows qo_indptr[b]:qo_indptr[b+1] of q; its pages are
    kv_indices[kv_indptr[b]:kv_indptr[b+1]], the last holding kv_last_page_len[b] tokens (MLA: kv_len[b] tokens);
  - NHD paged cache [pages, 2, page_size, kv_heads, head_dim] (K then V); MLA caches [pages, page_size, dim];
  - causal append: query i of a sequence with q_len new tokens and kv_len keys sees keys 0 .. kv_len - q_len + i;
  - query head h reads KV head h // (heads / kv_heads).

Built with `use_cuda_graph=True` and fixed buffers (FlashInfer's "cudagraph mode", decode.py / prefill.py), a wrapper
keeps its batch size (the buffers' length), its plan() writes the indptrs, page ids and last-page lengths into those
buffers and its run() reads them from there alone (as a replayed kernel does), noting their addresses.

It attends by an explicit masked softmax per sequence in float64 (not the torch backend's grouping or SDPA), so a
run through it checks the page metadata and the plan/run protocol the runtime gives FlashInfer. It records every
plan and run, and refuses a plan whose indptrs or lengths sit on another device than the CPU (FlashInfer would copy
them back, blocking) and a run before any plan.
"""

from __future__ import annotations

import types

import torch

# ("plan", devices of its index tensors) / ("run", number of query rows); a graph wrapper's: ("graph-plan", devices,
# batch) / ("graph-run", number of query rows)
CALLS: list[tuple] = []


def _host(*tensors: torch.Tensor, graph_batch: int | None = None) -> None:
    devices = {t.device.type for t in tensors}
    CALLS.append(("plan", devices) if graph_batch is None else ("graph-plan", devices, graph_batch))
    if devices != {"cpu"}:
        raise AssertionError(f"plan() got indptrs or lengths on {devices}: FlashInfer would copy them to the host")


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, q_len: int) -> torch.Tensor:
    """q [n, H, Dk], keys [kv, Hkv, Dk], values [kv, Hkv, Dv] -> [n, H, Dv], causal over the last n positions."""
    heads, kv_heads, kv_len = q.shape[1], keys.shape[1], keys.shape[0]
    group = heads // kv_heads
    keys, values = keys.double().repeat_interleave(group, 1), values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,khd->hnk", q.double(), keys) * scale  # [H, n, kv]
    visible = torch.arange(kv_len)[None, :] <= (kv_len - q_len + torch.arange(q_len))[:, None]  # [n, kv]
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return torch.einsum("hnk,khd->nhd", probs, values)


class _GraphBuffers:
    """A wrapper's fixed metadata buffers in cudagraph mode (None: planned per call)."""

    def __init__(self, use_cuda_graph: bool, qo_indptr, kv_indptr, kv_indices, last_page_len) -> None:
        self.on = use_cuda_graph
        if self.on:
            assert all(torch.is_tensor(t) for t in (kv_indptr, kv_indices, last_page_len)), "cudagraph mode: buffers"
            self.batch = last_page_len.shape[0]  # fixed for the wrapper's life
            assert kv_indptr.shape[0] == self.batch + 1 and (qo_indptr is None or qo_indptr.shape[0] == self.batch + 1)
        self.buffers = (qo_indptr, kv_indptr, kv_indices, last_page_len)
        self.addresses: set[tuple[int, ...]] = set()  # what each run read from

    def write(self, qo_indptr, kv_indptr, kv_indices, last_page_len) -> None:
        """plan(): the step's metadata into the buffers, as FlashInfer copies it (a batch of another size fails)."""
        qo_buf, kv_buf, pages_buf, last_buf = self.buffers
        if kv_indptr.shape[0] != self.batch + 1:
            raise ValueError(f"batch size fixed at {self.batch} in cudagraph mode, got {kv_indptr.shape[0] - 1}")
        if kv_indices.shape[0] > pages_buf.shape[0]:
            raise ValueError("more page indices than the buffer holds")
        if qo_buf is not None:
            qo_buf.copy_(qo_indptr)
        kv_buf.copy_(kv_indptr)
        last_buf.copy_(last_page_len)
        pages_buf[: kv_indices.shape[0]].copy_(kv_indices)

    def read(self, plan: dict, q_len: int) -> dict:
        """run(): the plan's metadata as the buffers hold it now."""
        qo_buf, kv_buf, pages_buf, last_buf = self.buffers
        self.addresses.add(tuple(t.data_ptr() for t in self.buffers if t is not None))
        kv = kv_buf.tolist()
        qo = qo_buf.tolist() if qo_buf is not None else list(range(0, (self.batch + 1) * q_len, q_len))
        return dict(plan, qo=qo, kv=kv, pages=pages_buf[: kv[-1]].tolist(), last=last_buf.tolist())


def _paged_attention(plan: dict, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
    """Each sequence's queries over its pages, from the plan's indptrs, page ids and last-page lengths."""
    out = torch.empty_like(q)
    ps = plan["page_size"]
    for b in range(len(plan["qo"]) - 1):
        rows = slice(plan["qo"][b], plan["qo"][b + 1])
        pages = plan["pages"][plan["kv"][b] : plan["kv"][b + 1]]
        kv_len = (len(pages) - 1) * ps + plan["last"][b]
        kv = paged_kv_cache[pages].transpose(0, 1).flatten(1, 2)[:, :kv_len]  # [2, kv_len, Hkv, D]
        out[rows] = _attend(q[rows], kv[0], kv[1], plan["scale"], rows.stop - rows.start).to(q.dtype)
    return out


class _PagedWrapper:
    """run() of both paged wrappers: from the plan, or in cudagraph mode from the buffers it wrote."""

    q_len = 0  # rows a sequence where no qo_indptr buffer says (decode: 1)

    def run(self, q: torch.Tensor, paged_kv_cache: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "run() before plan()"
        assert (q.shape[1], paged_kv_cache.shape[3], q.shape[2]) == plan["heads"]
        CALLS.append(("graph-run" if self.graph.on else "run", q.shape[0]))
        return _paged_attention(self.graph.read(plan, self.q_len) if self.graph.on else plan, q, paged_kv_cache)


class BatchPrefillWithPagedKVCacheWrapper(_PagedWrapper):
    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 qo_indptr_buf=None, paged_kv_indptr_buf=None, paged_kv_indices_buf=None,
                 paged_kv_last_page_len_buf=None) -> None:
        assert kv_layout == "NHD"
        self._plan: dict | None = None
        self.graph = _GraphBuffers(use_cuda_graph, qo_indptr_buf, paged_kv_indptr_buf, paged_kv_indices_buf,
                                   paged_kv_last_page_len_buf)
        if use_cuda_graph:
            assert torch.is_tensor(qo_indptr_buf), "cudagraph mode: qo_indptr_buf"

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads, num_kv_heads,
             head_dim_qk, page_size, *, causal=False, sm_scale=None, q_data_type=None, kv_data_type=None) -> None:
        _host(qo_indptr, paged_kv_indptr, paged_kv_last_page_len,
              graph_batch=self.graph.batch if self.graph.on else None)
        assert causal and sm_scale is not None
        self._plan = dict(qo=qo_indptr.tolist(), kv=paged_kv_indptr.tolist(), pages=paged_kv_indices.cpu().tolist(),
                          last=paged_kv_last_page_len.tolist(), page_size=page_size, scale=sm_scale,
                          heads=(num_qo_heads, num_kv_heads, head_dim_qk))
        if self.graph.on:
            self.graph.write(qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)


class BatchDecodeWithPagedKVCacheWrapper(_PagedWrapper):
    """One query row a sequence; FlashInfer's decode kernels (tensor cores or not: the same values)."""

    q_len = 1

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
                 use_tensor_cores: bool = False, paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None) -> None:
        assert kv_layout == "NHD"
        self._plan: dict | None = None
        self.graph = _GraphBuffers(use_cuda_graph, None, paged_kv_indptr_buffer, paged_kv_indices_buffer,
                                   paged_kv_last_page_len_buffer)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             sm_scale=None, q_data_type=None, kv_data_type=None) -> None:
        _host(indptr, last_page_len, graph_batch=self.graph.batch if self.graph.on else None)
        assert sm_scale is not None
        batch = indptr.shape[0] - 1
        self._plan = dict(qo=list(range(batch + 1)), kv=indptr.tolist(), pages=indices.cpu().tolist(),
                          last=last_page_len.tolist(), page_size=page_size, scale=sm_scale,
                          heads=(num_qo_heads, num_kv_heads, head_dim))
        if self.graph.on:
            self.graph.write(None, indptr, indices, last_page_len)


class BatchMLAPagedAttentionWrapper:
    def __init__(self, workspace: torch.Tensor) -> None:
        self._plan: dict | None = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe, page_size,
             causal, sm_scale, q_data_type, kv_data_type) -> None:
        _host(qo_indptr, kv_indptr, kv_len_arr)
        assert causal
        self._plan = dict(qo=qo_indptr.tolist(), kv=kv_indptr.tolist(), pages=kv_indices.cpu().tolist(),
                          lens=kv_len_arr.tolist(), scale=sm_scale)

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "run() before plan()"
        CALLS.append(("run", q_nope.shape[0]))
        out = torch.empty_like(q_nope)
        for b in range(len(plan["qo"]) - 1):
            rows = slice(plan["qo"][b], plan["qo"][b + 1])
            pages, kv_len = plan["pages"][plan["kv"][b] : plan["kv"][b + 1]], plan["lens"][b]
            latent = ckv_cache[pages].flatten(0, 1)[:kv_len, None]  # [kv_len, 1, R]: one head for all queries
            keys = torch.cat((latent, kpe_cache[pages].flatten(0, 1)[:kv_len, None]), dim=-1)
            query = torch.cat((q_nope[rows], q_pe[rows]), dim=-1)
            out[rows] = _attend(query, keys, latent, plan["scale"], rows.stop - rows.start).to(q_nope.dtype)
        return out


mla = types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper)
