"""Paged attention on fixed-shape buffers, the attention a captured forward calls (`infer.cuda_graphs`).

Its metadata are tensors the graph runner fills before each replay: a block table [bs, pages] (padded sequences
name a reserved dummy page), each token's position and the cache rows its K and V go to. Shapes depend only on the
padded batch size, the query length and the key capacity, never on the lengths inside: no host read and no
data-dependent shape, so a CUDA graph can hold it and torch.compile(fullgraph=True) can trace it on a CPU.
Each sequence's keys are read up to the capacity and masked at its queries' positions (causal within the step).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infer.attention.backend import write_kv_rows


class StaticPagedAttention:
    """One forward's attention over static views: `bind` picks the views of the runner's buffers for a graph's shape
    (host work, once per graph); `prepare` derives the rows every layer reads and the mask (device work, inside the
    captured callable); `attend` is each layer's."""

    output_rows = None  # every row's output is computed

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size

    def bind(self, block_table: torch.Tensor, positions: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor,
             q_len: int) -> None:
        """block_table [bs, pages], positions [bs * q_len], k_rows / v_rows [bs * q_len]: views of static buffers."""
        self.block_table, self.positions, self.k_rows, self.v_rows = block_table, positions, k_rows, v_rows
        self.batch, self.q_len = block_table.shape[0], q_len
        self.capacity = block_table.shape[1] * self.page_size

    def prepare(self) -> None:
        """The flat cache rows of every key slot [bs * 2 * capacity] (each sequence's K rows, then its V rows) and
        the visibility mask [bs, 1, q_len, capacity] (key j is seen by a query at position p where j <= p)."""
        size = self.page_size
        offsets = torch.arange(size, device=self.block_table.device)
        k_rows = (2 * size * self.block_table[:, :, None] + offsets).flatten(1)  # [bs, capacity]
        self.kv_read = torch.stack((k_rows, k_rows + size), dim=1).flatten()
        keys = torch.arange(self.capacity, device=self.block_table.device)
        self.mask = (keys <= self.positions.view(self.batch, self.q_len, 1))[:, None]

    def plan(self, meta) -> None:
        raise RuntimeError("StaticPagedAttention is filled by its graph runner (bind, prepare), not planned")

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
               scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D] -> [T, H, D]; k/v go into kv_cache first (padded rows: the dummy page)."""
        flat = write_kv_rows(kv_cache, self.k_rows, self.v_rows, k, v)
        kv_heads, dim = flat.shape[1:]
        keys, values = (flat.index_select(0, self.kv_read).view(self.batch, 2, self.capacity, kv_heads, dim)
                        .to(q.dtype).transpose(2, 3).unbind(1))  # [bs, Hkv, capacity, D] each
        heads = q.shape[1]
        queries = q.view(self.batch, self.q_len, heads, dim).transpose(1, 2)  # [bs, H, q_len, D]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self.mask, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], heads, dim)

    def attend_mla(self, *args, **kwargs) -> torch.Tensor:
        raise NotImplementedError("MLA models run eagerly: the graph runner serves GQA models only")
