"""The sequences of a step that attend as one batch (`QueryGroup`), and the attention over one group's keys."""

from __future__ import annotations

from functools import cached_property

import torch
import torch.nn.functional as F

from infer.attention.backend import kv_rows
from infer.attention.buckets import additive_mask
from infer.kv_cache import PageMetadata

SHORT_QUERIES = 8  # query lengths up to this (decodes, verify rows, catch-ups) share one padded group


class QueryGroup:
    """Sequences of one step attended as one batch, keys padded to the group's longest kv length only.

    `TorchAttention.plan` groups a step's sequences: all short ones (q_len <= SHORT_QUERIES) together, queries padded
    to the longest (a few rows: cheaper than another SDPA call), and each longer query length on its own, unpadded,
    so a long prefill chunk never pads the decodes beside it. Built once per step; every layer reuses it.
      rows       [n * q_len] the group's query rows in the packed batch (padding: any valid row), None when the group
                 is the whole batch in order, unpadded
      out_rows   [sum q_lens] where the group's outputs go in the packed batch
      read_shape (n, max_kv): the keys a layer reads, gathered from the cache (read_slots) or a kept mirror
      mask       [n, 1, q_len, max_kv] the keys each query sees, None when it sees them all
    """

    def __init__(self, meta: PageMetadata, seqs: torch.Tensor | None, q_lens: list[int], kv_lens: list[int],
                 kv_lens_t: torch.Tensor | None = None) -> None:
        """seqs: the group's sequences (None: all, in order); q_lens, kv_lens: theirs; kv_lens_t: kv_lens as a
        tensor where they are not meta.kv_lens (output rows: the keys each row sees)."""
        device = meta.positions.device
        self.page_size = meta.page_size
        q_len = self.q_len = max(q_lens)
        self.num_seqs = len(kv_lens)
        # int32 metadata indexes and promotes to int64 as it meets the int64 aranges: no casts needed.
        kv_lens_t = meta.kv_lens if kv_lens_t is None else kv_lens_t
        kv_start, qo_start = meta.kv_indptr[:-1], meta.qo_indptr[:-1]
        if seqs is not None:
            kv_lens_t, kv_start, qo_start = kv_lens_t[seqs], kv_start[seqs], qo_start[seqs]
        q_pos = torch.arange(q_len, device=device)
        self.q_valid = self.rows = None
        if min(q_lens) < q_len:  # padded
            q_lens_t = (meta.qo_indptr[1:] - meta.qo_indptr[:-1]) if seqs is None else torch.tensor(q_lens, device=device)
            self.q_valid = q_pos[None, :] < q_lens_t[:, None]  # [n, q_len]
            q_rows = qo_start[:, None] + q_pos
            self.out_rows = q_rows[self.q_valid]
            self.rows = q_rows.clamp_(max=meta.num_tokens - 1).flatten()
            kv_first = kv_lens_t - q_lens_t  # padded queries see their sequence's keys (outputs dropped)
        else:
            if seqs is not None:
                self.rows = self.out_rows = (qo_start[:, None] + q_pos).flatten()
            kv_first = None if q_len == 1 else kv_lens_t - q_len
        # Prompts with nothing cached (a fresh prefill, the feature precompute): SDPA's causal kernel over the chunk's
        # own keys; no cache read, no explicit mask (a padded query's keys are garbage rows past its chunk, its
        # output dropped).
        self.fresh = q_len > 1 and all(kv == q for kv, q in zip(kv_lens, q_lens))
        self.visible, self.step, self._sdpa_masks = None, None, {}
        if self.fresh:
            return
        max_kv = max(kv_lens)
        self._kv_start, self._kv_indices = kv_start, meta.kv_indices  # for read_slots, built only if a layer gathers
        self.read_shape = (self.num_seqs, max_kv)
        # Causal: query j of sequence b sits at position kv_len - q_len + j and sees the keys up to it.
        if kv_first is None and min(kv_lens) < max_kv:
            self.set_visible(kv_lens_t[:, None])
        elif kv_first is not None:
            self.set_visible(kv_first[:, None] + torch.arange(1, q_len + 1, device=device))

    @cached_property
    def kv_read(self) -> torch.Tensor:
        """[2 * n * max_kv] rows of a K/V cache's flat view (see kv_rows): K of every key, then V."""
        return kv_rows(self.read_slots, self.page_size)

    @cached_property
    def read_slots(self) -> torch.Tensor:
        """[n * max_kv] token slots of every key (MLA caches are indexed by them): the page of each key (padding
        clamped to a valid one, masked) and its offset in the page."""
        kv_pos = torch.arange(self.read_shape[1], device=self._kv_start.device)
        page_slot = (self._kv_start[:, None] + kv_pos[None, :] // self.page_size).clamp_(
            max=max(self._kv_indices.shape[0] - 1, 0))
        return (self._kv_indices[page_slot] * self.page_size + kv_pos % self.page_size).flatten()

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[T, H, D] packed -> [n, H, q_len, D]."""
        if self.rows is not None:
            x = x.index_select(0, self.rows)
        return x.view(self.num_seqs, self.q_len, *x.shape[1:]).transpose(1, 2)

    def unpad(self, out: torch.Tensor) -> torch.Tensor:
        """[n, H, q_len, D] -> [sum q_lens, H, D]."""
        if self.q_valid is not None:
            return out.transpose(1, 2)[self.q_valid]
        return out.transpose(1, 2).reshape(-1, *out.shape[1:2], out.shape[-1])

    def set_visible(self, visible: torch.Tensor | None, step: int | None = None) -> None:
        """The keys each query row sees: visible [n, q_len] counts (the first ones of its sequence), None: all keys;
        a decode run's [S, n, 1] for all its steps, with the step this forward is. The SDPA masks built from
        another `visible` are dropped; a run's are built once for all its steps."""
        if visible is not self.visible:
            self._sdpa_masks = {}
        self.visible, self.step = visible, step

    def sdpa_mask(self, dtype: torch.dtype, group_size: int, kv_heads: int = 1) -> torch.Tensor | None:
        """The mask as attention takes it cheapest, built once per step (or decode run) and reused by every layer:
        additive (0 / -inf) in the queries' dtype (SDPA converts a boolean mask on every call), rows repeated for the
        query heads folded into them (see attend_cached; a decode's one row broadcasts): [n, 1, rows, max_kv], or
        [n, kv_heads, rows, max_kv] laid out for every KV head, as the batched matmuls add it (`attention`)."""
        if self.visible is None:
            return None
        built = self._sdpa_masks.get((dtype, group_size, kv_heads))
        if built is None:
            visible = self.visible
            if self.q_len > 1:  # [n, q_len] -> [n, q_len * G], row j * G + g
                visible = visible[..., None].expand(*visible.shape, group_size).flatten(-2)
            built = additive_mask(visible, self.read_shape[1], dtype)[..., None, :, :]
            if kv_heads > 1:
                built = built.expand(*built.shape[:-3], kv_heads, *built.shape[-2:]).contiguous()
            self._sdpa_masks[(dtype, group_size, kv_heads)] = built
        return built if self.step is None else built[self.step]

    def attend_cached(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
        """q [T, H, Dk] packed, keys [n, Hkv, max_kv, Dk], values [n, Hkv, max_kv, Dv] -> [sum q_lens, H, Dv].

        The G = H / Hkv query heads that share a KV head are folded into its query rows ([n, Hkv, q_len * G, Dk],
        row j * G + g: position j of query head g): one SDPA call without GQA reads each key once per KV head,
        where `enable_gqa` copies the keys and values out for every query head (G = every head for MLA's one
        latent head). A view for decodes; longer queries pay a copy in and out, which the single call repays
        (see docs/benchmark_history.md).
        """
        n, kv_heads, heads, dk = self.num_seqs, keys.shape[1], q.shape[1], q.shape[2]
        if self.rows is not None:
            q = q.index_select(0, self.rows)
        mask = self.sdpa_mask(q.dtype, heads // kv_heads, kv_heads if matmul_attention(n, q.dtype, q.device) else 1)
        if self.q_len == 1:
            # reshape: CUDA's fused SDPA kernels return [n, Hkv, rows, D] in [n, rows, Hkv, D] memory (a view fails)
            return attention(q.view(n, kv_heads, -1, dk), keys, values, mask, scale).reshape(n, heads, -1)
        folded = q.view(n, self.q_len, kv_heads, -1, dk).transpose(1, 2).reshape(n, kv_heads, -1, dk)
        out = attention(folded, keys, values, mask, scale)
        out = out.reshape(n, kv_heads, self.q_len, -1, out.shape[-1]).transpose(1, 2)
        out = out.reshape(n * self.q_len, heads, -1)
        return out if self.q_valid is None else out[self.q_valid.flatten()]


MATMUL_ATTENTION_MIN_SEQS = 12  # see `attention`


def matmul_attention(num_seqs: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `attention` takes its batched-matmul path for a group of `num_seqs` sequences (over a mirror's keys)."""
    return num_seqs >= MATMUL_ATTENTION_MIN_SEQS and dtype == torch.float32 and device.type == "cpu"


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """q [n, Hkv, rows, Dk] over keys [n, Hkv, L, Dk] and values [n, Hkv, L, Dv], mask additive or None.

    SDPA, except for fp32 CPU queries of at least MATMUL_ATTENTION_MIN_SEQS sequences over a mirror's keys (each
    head's keys contiguous, row by row or, as the mirror keeps them for this path, transposed: each head's [Dk, L]
    rows of positions), where two batched matmuls and a softmax beat SDPA's CPU kernel, whose cost there goes to its
    many tiny per-(sequence, head) tiles (the threshold where they start to win: see docs/benchmark_history.md).
    Keys stored transposed are what the scores' matmul reads (a [Dk, L] slice of rows), where keys stored row by row
    are copied transposed by the matmul on every call (KVMirror); values stored transposed too ([Dv, L]) are read by
    the second matmul as a transposed operand. A mask is added, and the scale applied, by the scores' matmul itself
    (baddbmm), the mask laid out for every KV head (`QueryGroup.sdpa_mask`: a view here, where one of one head would be
    copied out per call)."""
    if matmul_attention(q.shape[0], q.dtype, q.device) and keys.stride(-2) in (keys.shape[-1], 1):
        n, kv_heads, rows, dk = q.shape
        length = keys.shape[-2]
        q, keys_t = q.reshape(n * kv_heads, rows, dk), keys.transpose(-1, -2).reshape(n * kv_heads, dk, length)
        if mask is None:
            scores = torch.bmm(q * scale, keys_t)
        else:
            mask = mask.expand(n, kv_heads, mask.shape[-2], length).reshape(n * kv_heads, -1, length)
            scores = torch.baddbmm(mask, q, keys_t, alpha=scale)
        values = values.reshape(n * kv_heads, length, values.shape[-1])
        return torch.bmm(scores.softmax(-1), values).view(n, kv_heads, rows, -1)  # [n, Hkv, rows, Dv]
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
