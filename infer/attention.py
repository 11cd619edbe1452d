"""Attention over the paged KV cache, behind one interface with two backends.

A backend is planned once per step from the step's `PageMetadata` (all layers share the plan) and then
called by every layer. Two attention kinds are served:
  - `attend`:     grouped-query attention; the layer's cache is [num_pages, 2, page_size, kv_heads, head_dim]
                  (FlashInfer's NHD layout, K at index 0, V at 1).
  - `attend_mla`: DeepSeek's multi-head latent attention in its absorbed form: queries already multiplied
                  by W_UK, keys are [compressed latent ; rope key] shared by all heads, values are the latent.
                  Caches: ckv [num_pages, page_size, kv_lora_rank] and kpe [num_pages, page_size, rope_dim]
                  (FlashInfer's MLA layout).
`TorchAttention` groups a step's sequences by query length, gathers each group's keys into a batch (or reads them
from the mirror it keeps while its forwards attend the same sequences) and calls SDPA (CPU, tests);
`FlashInferAttention` runs FlashInfer's paged kernels (GPU), imported only when chosen. A step may ask for one
output row per sequence (`PageMetadata.output_rows`: a one-layer head's catch-up); a backend says which rows it
computed in its own `output_rows`.
"""

from __future__ import annotations

import importlib.util
import math
from functools import cached_property
from typing import Protocol

import torch
import torch.nn.functional as F

from infer.kv_cache import DecodeSteps, PageMetadata


class AttentionBackend(Protocol):
    # The rows of the packed batch whose outputs attend returns (None: all); a layer keeps those rows of its residual
    # (`infer.models.common.keep_output_rows`). Set by plan: the step's `PageMetadata.output_rows`, where the backend
    # computes those rows alone.
    output_rows: torch.Tensor | None

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
    """Token slots [..., N] (page * page_size + offset) -> rows of a K/V cache's flat view [..., 2N]: K rows, then
    V rows (the keys a group reads; the new tokens' rows come listed in `PageMetadata.cache_rows`).

    A [pages, 2, page_size, ...] cache viewed flat puts K of page p at rows 2p * page_size + offset and V one
    page_size further. MLA caches ([pages, page_size, ...]) are indexed by the slots themselves.
    """
    k_rows = slots + (slots // page_size) * page_size
    return torch.cat((k_rows, k_rows + page_size), dim=-1)


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype; x itself when it is already (`Tensor.to` returns it too, after a dispatch of 2 us: ten a step
    of a five-layer model at batch 1, where a forward is op dispatch)."""
    return x if x.dtype == dtype else x.to(dtype)


def write_kv(kv_cache: torch.Tensor, rows: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Store kv = cat(K, V) [2T, Hkv, D] into a [pages, 2, page_size, Hkv, D] cache at `rows` (kv_rows); returns its
    flat [pages*2*page_size, Hkv, D] view."""
    flat = kv_cache.view(-1, *kv_cache.shape[-2:])
    flat.index_copy_(0, rows, kv)
    return flat


def write_mla(cache: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Store latents or rope keys into a [pages, page_size, dim] cache; returns its flat view."""
    flat = cache.view(-1, cache.shape[-1])
    flat.index_copy_(0, rows, values.to(cache.dtype))
    return flat


KV_BUCKET_MIN = 16  # short queries split by kv length only into groups of at least this many sequences,
KV_BUCKET_KEYS = 8192  # only when one group would pad to at least this many keys (smaller attention is op-bound)
KV_BUCKET_GAIN = 0.75  # and only when the groups' padded keys are at most this share of one group's


def kv_buckets(seqs: list[int], kv_lens: list[int]) -> list[list[int]]:
    """The short queries' sequences in groups whose kv lengths lie within a factor of 2 (powers-of-two bins, a bin
    of fewer than KV_BUCKET_MIN sequences merged into the next longer one): padding every key block to a batch's
    longest wastes up to half of a decode step's attention when lengths spread (generation at batch 128), while
    each group costs a gather and an SDPA call per layer, so the split is kept only for large key blocks and where it
    pads a quarter fewer keys."""
    if len(seqs) < 2 * KV_BUCKET_MIN or len(seqs) * max(kv_lens[b] for b in seqs) < KV_BUCKET_KEYS:
        return [seqs]
    bins: dict[int, list[int]] = {}
    for b in seqs:
        bins.setdefault(kv_lens[b].bit_length(), []).append(b)
    groups: list[list[int]] = []
    pending: list[int] = []
    for key in sorted(bins):
        pending += bins[key]
        if len(pending) >= KV_BUCKET_MIN:
            groups.append(pending)
            pending = []
    if pending:
        if groups:
            groups[-1] += pending
        else:
            groups.append(pending)
    padded = lambda group: len(group) * max(kv_lens[b] for b in group)  # noqa: E731
    return groups if sum(map(padded, groups)) <= KV_BUCKET_GAIN * padded(seqs) else [seqs]


_MASK_TEMPLATES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
MASK_ALIGN = 8  # elements between mask rows are a multiple of this: 16 bytes in bf16, 32 in fp32


def additive_mask(visible: torch.Tensor, width: int, dtype: torch.dtype) -> torch.Tensor:
    """visible [...] key counts (each at least 1) -> [..., width] additive mask rows: `visible` zeros, then -inf.

    One index_select of rows cut from a constant template (M zeros, then M times -inf; the row for c keys starts at
    M - c), where comparing positions and filling a mask costs three ops: a step's plan is op-bound here.

    Rows are laid out MASK_ALIGN elements apart (the view keeps `width`), so that every row, and every step's slab
    of a decode run's masks, starts 16-byte aligned: CUDA's fused SDPA kernels read the mask with vector loads and
    fault on a misaligned start ("misaligned address", seen on an H200 with a decode run's step j > 0 at odd widths).
    """
    stride = -(-width // MASK_ALIGN) * MASK_ALIGN
    key = (dtype, visible.device)
    template = _MASK_TEMPLATES.get(key)
    if template is None or template.shape[0] < 2 * stride:
        half = max(256, stride, 0 if template is None else template.shape[0])
        template = torch.zeros(2 * half, dtype=dtype, device=visible.device)
        template[half:] = float("-inf")
        _MASK_TEMPLATES[key] = template
    half = template.shape[0] // 2
    rows = template.unfold(0, stride, 1).index_select(0, torch.rsub(visible, half).flatten())
    return rows.view(*visible.shape, stride)[..., :width]


SHORT_QUERIES = 8  # query lengths up to this (decodes, verify rows, catch-ups) share one padded group
MIRROR_BYTES = 256 << 20  # the most a backend keeps in mirrored keys and values (_Mirror)
MIRROR_SLACK = 64  # positions a new mirror holds past the longest sequence: it is gathered anew when one outgrows it


class _Group:
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
        latent head). A view for decodes; longer queries pay a copy in and out, repaid from batch 8 on (verify
        rows at K=4, stories260K: 0.87x the attention time at batch 8, the same at batch 1).
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
    many tiny per-(sequence, head) tiles (stories260K, 4 KV heads of 8 dims, 90 keys, decodes / verify rows: 0.78x /
    0.90x its time at batch 24, 0.85x / 0.87x at 16, 0.94x / 0.95x at 12, 1.13x / 1.00x at 8, 1.49x / 1.25x at 4;
    infer.bench at batch 12 and 16, 1.00-1.02x tokens/s with the threshold at 12 against 24). Keys stored transposed
    are what the scores' matmul reads (a [Dk, L] slice of rows), where keys stored row by row are copied transposed by
    the matmul on every call (_Mirror): plain decoding at batch 32, the batched matmuls 0.83x their time, a step
    0.97x. Values stored transposed too ([Dv, L]) are read by the second matmul as a transposed operand: at batch 32
    0.78x its time over 72 keys, 0.68x over 200. A mask is added, and the scale applied, by the scores' matmul itself
    (baddbmm), the mask laid out for every KV head (`_Group.sdpa_mask`: a view here, where one of one head would be
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


class _Mirror:
    """One batch's keys and values, per GQA layer, in one contiguous block each: a copy of the paged cache that a
    backend keeps while its forwards attend the same sequences, so a layer reads its keys as a view instead of a
    gather from the pages.

    A block is [2, n, Hkv, capacity * D], K then V, head-major: a head's keys and values are [capacity, D] rows (the
    row of a key is its position), or, where the batch attends by matmul (`matmul_attention`), transposed, [D,
    capacity], the layout both matmuls read fastest (`attention`).

    It stays exact because every forward of the backend writes its tokens into it as into the cache, and any forward
    over other sequences replaces it: a position a forward reads was written since the mirror was built, through the
    mirror, or before, and then gathered into it, from the cache or, for the sequences the mirror it replaced held
    (that mirror current up to the forward before: `inherit`), from that mirror's block; positions past a sequence's
    length are masked, as in the cache. A forward of several groups (or a fresh prefill) drops it.
    """

    def __init__(self, first_pages: torch.Tensor, capacity: int) -> None:
        self.first_pages = first_pages  # [n] each sequence's first page: which sequences, in which order
        self.capacity = capacity
        self.transposed: bool | None = None  # set by the first gather: by the batch's attention path
        self.blocks: dict[int, torch.Tensor] = {}  # layer cache data_ptr -> its block
        self.unkept: set[int] = set()  # layers past MIRROR_BYTES: they gather every forward
        self.bytes = 0
        self._offsets: dict[tuple[int, int], torch.Tensor] = {}  # (Hkv, D) -> each head's first index, K then V
        self._starts: dict[tuple[int, ...], torch.Tensor] = {}  # q_lens -> [T] each token's sequence's first row
        self.source: _Mirror | None = None  # the mirror this one replaced, while it has blocks to hand over (inherit)
        self.source_rows: torch.Tensor | None = None  # [n] each sequence's row there, -1 where it had none

    def holds(self, first_pages: torch.Tensor) -> bool:
        """Whether it mirrors these sequences, in this order."""
        return first_pages.shape == self.first_pages.shape and torch.equal(first_pages, self.first_pages)

    def views(self, block: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A block's keys and values at positions 0..length-1: two [n, Hkv, length, D] views."""
        n, kv_heads = block.shape[1:3]
        if not self.transposed:
            rows = block.view(2, n, kv_heads, self.capacity, -1)[:, :, :, :length]
            return rows[0], rows[1]
        columns = block.view(2, n, kv_heads, -1, self.capacity)[..., :length].transpose(-1, -2)
        return columns[0], columns[1]

    def write(self, block: torch.Tensor, index: torch.Tensor, kv: torch.Tensor) -> None:
        """kv = cat(K, V) [2T, Hkv, D] into the block at `index` (`rows`, flattened)."""
        if self.transposed:
            block.view(-1).index_copy_(0, index, kv.flatten())
        else:
            block.view(-1, kv.shape[-1]).index_copy_(0, index, kv.view(-1, kv.shape[-1]))

    def rows(self, q_lens: list[int], positions: torch.Tensor, kv_heads: int, dim: int) -> torch.Tensor:
        """Each sequence's new tokens (q_lens, packed) at their positions [T] -> where a block takes their keys, then
        their values (`write`): [2, T, Hkv], rows of its flat [2 * n * Hkv * capacity, D] view, or, transposed,
        [2, T, Hkv, D], elements of its flat view (positions may be [S, B], S steps of a run -> [2, S, B, Hkv(, D)]).
        What depends only on the mirror's layout is built once."""
        head_rows = self.capacity * kv_heads  # one sequence's rows
        values_at = len(self.first_pages) * head_rows  # the values' first row
        offsets = self._offsets.get((kv_heads, dim))
        device = positions.device
        if offsets is None:
            if self.transposed:  # [2, Hkv, D]: element d of head h starts row h * D + d of positions
                h, d = torch.arange(kv_heads, device=device)[:, None], torch.arange(dim, device=device)
                offsets = torch.stack(((h * dim + d) * self.capacity, values_at * dim + (h * dim + d) * self.capacity))
            else:
                heads = torch.arange(0, head_rows, self.capacity, device=device)  # [Hkv]
                offsets = torch.stack((heads, heads + values_at))
            self._offsets[(kv_heads, dim)] = offsets
        key = tuple(q_lens)
        starts = self._starts.get(key)
        if starts is None:
            starts = torch.tensor([b * head_rows for b, q_len in enumerate(q_lens) for _ in range(q_len)],
                                  device=device)
            self._starts[key] = starts
        if not self.transposed:
            token_rows = starts + positions  # [T] or [S, B]
            return offsets.view(2, *[1] * token_rows.dim(), kv_heads) + token_rows[..., None]
        columns = starts * dim + positions  # each token's column: its sequence's first element, then its position
        return offsets.view(2, *[1] * positions.dim(), kv_heads, dim) + columns[..., None, None]

    def inherit(self, old: "_Mirror") -> None:
        """Take the rows of the sequences `old` mirrors too from its blocks (`gather`), not from the pages: a batch
        whose requests end and begin a few at a time (continuous batching) copies its other rows once, contiguous,
        where a gather reads them position by position from the pages. `old` was current up to the last forward."""
        row_of = {page: row for row, page in enumerate(old.first_pages.tolist())}
        rows = [row_of.get(page, -1) for page in self.first_pages.tolist()]
        if old.blocks and max(rows) >= 0:
            self.source, self.source_rows = old, torch.tensor(rows, device=self.first_pages.device)

    def gather(self, flat: torch.Tensor, group: "_Group") -> tuple[torch.Tensor | None, bool]:
        """A layer's first read: its keys and values in a new block, kept while MIRROR_BYTES allow (None past them),
        and whether some rows came from the mirror this one replaced (`inherit`): those lack this forward's tokens,
        which the caller writes; the rest are gathered from the cache, this forward's tokens in it already."""
        batch = group.read_shape[0]
        kv_heads, dim = flat.shape[1:]
        layer = flat.data_ptr()
        source = self.source
        old = None if source is None else source.blocks.pop(layer, None)
        if source is not None and not source.blocks:
            self.source = None  # every layer has taken its rows: the old mirror can go
        shape = (2, batch, kv_heads, self.capacity * dim)
        nbytes = math.prod(shape) * flat.element_size()
        if self.bytes + nbytes > MIRROR_BYTES:
            self.unkept.add(layer)
            return None, False
        if self.transposed is None:
            self.transposed = matmul_attention(batch, flat.dtype, flat.device)
        block = flat.new_empty(shape)
        copied = old is not None and source.transposed == self.transposed
        if copied:
            self._copy_rows(block, source, old, flat, group)
        else:
            self._from_pages(block, flat, group)
        self.blocks[layer] = block
        self.bytes += nbytes
        return block, copied

    def _copy_rows(self, block: torch.Tensor, source: "_Mirror", old: torch.Tensor, flat: torch.Tensor,
                   group: "_Group") -> str:
        """Fill a new block: the inherited sequences' rows from the old mirror's block `old`, the others gathered
        from the cache; past what each holds, zeros. Returns how the rows went over: "whole rows" (both blocks of one
        capacity, the inherited sequences leading the batch, as when requests end and new ones join at its end),
        "in order" (they lead the batch in their old rows: slices, as when a batch outgrows its mirror) or "by
        position" (indexed, position by position)."""
        src = self.source_rows
        kept = (src >= 0).nonzero()[:, 0]
        fresh = (src < 0).nonzero()[:, 0]
        keys, values = self.views(block, self.capacity)  # [n, Hkv, capacity, D] each
        m = kept.numel()
        first = torch.arange(m, device=kept.device)
        c = min(self.capacity, source.capacity)
        old_keys, old_values = source.views(old, c)
        if self.capacity == source.capacity and torch.equal(kept, first):
            path = "whole rows"
            for half in (0, 1):
                torch.index_select(old[half], 0, src[:m], out=block[half, :m])
        elif torch.equal(src[:m], first):  # rows 0..m-1 here were rows 0..m-1 there
            path = "in order"
            for new, prior in ((keys, old_keys), (values, old_values)):
                new[:m, :, :c].copy_(prior[:m])
                new[:m, :, c:].zero_()
        else:
            path = "by position"
            for new, prior in ((keys, old_keys), (values, old_values)):
                new[kept, :, :c] = prior[src[kept]]
                new[kept, :, c:] = 0
        if fresh.numel():
            self._from_pages(block, flat, group, fresh)
        return path

    def _from_pages(self, block: torch.Tensor, flat: torch.Tensor, group: "_Group",
                    seqs: torch.Tensor | None = None) -> None:
        """The rows of `seqs` (None: every sequence) in a new block, gathered from the cache (this forward's tokens in
        it already), and zeros past them, where a masked key must never hold a NaN (0 * NaN would leak into SDPA);
        the gathered positions are the cache's, which starts zeroed."""
        batch, max_kv = group.read_shape
        if seqs is None:
            read = group.kv_read  # the group's read plan, shared by its layers
        else:
            read = kv_rows(group.read_slots.view(batch, max_kv)[seqs].flatten(), group.page_size)
        gathered = flat.index_select(0, read).view(2, -1, max_kv, *flat.shape[1:]).transpose(2, 3)
        for rows, new in zip(gathered, self.views(block, self.capacity)):  # keys, then values
            if seqs is None:
                new[:, :, :max_kv].copy_(rows)
                new[:, :, max_kv:].zero_()
            else:
                new[seqs, :, :max_kv] = rows
                new[seqs, :, max_kv:] = 0


def _first_pages(meta: PageMetadata) -> torch.Tensor:
    host = meta.on_host()
    return host.kv_indices[host.kv_indptr[:-1]]


class TorchAttention:
    """Paged attention in plain PyTorch: per group of query lengths (see _Group), gather the sequences' keys into
    a batch, then SDPA.

    Everything that depends only on the page tables (groups, gather indices, masks) is built in `plan`, once per
    step, so each layer costs one scatter, and per group one gather and one SDPA call. While successive forwards
    attend the same sequences as one group (a speculating batch's verify forwards, a drafter's catch-ups and
    drafts, decode steps), each GQA layer keeps their keys in a `_Mirror` (within MIRROR_BYTES) and reads them
    from it as a view: no gather per forward, and no gather indices to build. A decode run (DecodeSteps) is
    planned once, on its first step: every step reads the keys of the last, masked.
    """

    def __init__(self) -> None:
        self._run = None
        self._mirror: _Mirror | None = None
        # what this forward writes into the mirror: (q_lens, positions), or a decode run and its step
        self._mirror_tokens: tuple | None = None
        self.mirror_write = None  # this forward's rows in the mirror's blocks, None when it reads no mirror
        self.output_rows = None

    def plan(self, meta: PageMetadata) -> None:
        # Caches are read and written through flat views with index_copy_/index_select (one kernel each, far
        # cheaper than multi-dimensional indexing); the writes' rows come with the metadata (cache_rows), the reads'
        # are derived on the step's first layer that gathers (_Group.kv_read / read_slots), so a model pays only for
        # the cache layout it has.
        self.page_size = meta.page_size
        self.write_slots, self.kv_write = meta.slot_mapping, meta.cache_rows
        self.mirror_write = self._mirror_tokens = self.output_rows = None
        if meta.decode_run is not None:
            self._plan_decode_step(meta)
            return
        self._run = None
        batch, host = meta.batch_size, meta.on_host()  # the lengths as built on the host: no device sync
        kv_lens = host.kv_lens.tolist()
        q_lens = [1] * batch if meta.max_q_len == 1 else (host.qo_indptr[1:] - host.qo_indptr[:-1]).tolist()
        if meta.output_rows is not None and meta.max_q_len > 1:  # those rows attend, as decodes at their positions
            self.output_rows = meta.output_rows
            row_kv_lens = meta.positions[meta.output_rows] + 1  # [B] the keys each row sees
            self.groups = [_Group(meta, None, [1] * batch, row_kv_lens.tolist(), row_kv_lens)]
            self._keep_mirror(meta, max(kv_lens))  # it holds what the forward writes
            self._mirror_tokens = (q_lens, meta.positions)  # every token's K/V is written
            return
        short, by_q_len = [], {}  # the short queries; each longer query length's sequences
        for b, q_len in enumerate(q_lens):
            if q_len > SHORT_QUERIES:
                by_q_len.setdefault(q_len, []).append(b)
            else:
                short.append(b)
        # the short queries by kv length (a group's keys are padded to its longest)
        groupings = (kv_buckets(short, kv_lens) if short else []) + list(by_q_len.values())
        if len(groupings) == 1:
            self.groups = [_Group(meta, None, q_lens, kv_lens)]
            if not self.groups[0].fresh:
                self._keep_mirror(meta, max(kv_lens))
                self._mirror_tokens = (q_lens, meta.positions)
                return
        else:
            device = meta.positions.device
            self.groups = [_Group(meta, torch.tensor(seqs, device=device), [q_lens[b] for b in seqs],
                                  [kv_lens[b] for b in seqs]) for seqs in groupings]
            self.out_rows = torch.cat([g.out_rows for g in self.groups])  # where each group's outputs go
        self._mirror = None  # other sequences, or several groups: the next forward over one group gathers anew

    def _keep_mirror(self, meta: PageMetadata, max_kv: int) -> _Mirror:
        """The mirror of this forward's sequences: the one kept, or a new one, whose blocks the layers build as they
        first read (the rows of the sequences the last one held copied from it, `_Mirror.inherit`; the others
        gathered from the pages)."""
        first_pages, mirror = _first_pages(meta), self._mirror
        held = mirror is not None and mirror.holds(first_pages)
        if not held or max_kv > mirror.capacity:
            # outgrown by the same sequences: twice the longest, so a batch that decodes on regathers a few times
            capacity = max(max_kv + MIRROR_SLACK, 2 * max_kv if held else 0)
            self._mirror = _Mirror(first_pages, -(-capacity // self.page_size) * self.page_size)
            if mirror is not None:  # it was current up to the last forward: its rows go over, not the pages
                self._mirror.inherit(mirror)
        return self._mirror

    def _plan_decode_step(self, meta: PageMetadata) -> None:
        """Step j of a DecodeSteps run (the draft forwards, plain decode runs): its first step plans every step.

        All steps read the keys of the run's last step (the longest: each sequence's pages up to it) and mask the
        positions step j has not written yet: one gather plan and one mask build for the run instead of one per step.
        """
        run = meta.decode_run
        if run is not self._run:
            self._run = run
            last = run.step(run.num_steps - 1)
            self._run_group = _Group(last, None, [1] * last.batch_size, last.on_host().kv_lens.tolist())
            self._run_visible = run.kv_lens[:, :, None]  # [S, B, 1]: the run's masks are built once
            self._run_mirror = None
        group = self._run_group
        group.set_visible(self._run_visible, meta.decode_step)
        self.groups = [group]
        if self._mirror is None or self._mirror is not self._run_mirror:  # the run's mirror serves all its steps
            # another mirror: the run's rows in its blocks are built anew, by the first layer that writes into it
            self._run_mirror, self._run_mirror_writes = self._keep_mirror(meta, group.read_shape[1]), None
        self._mirror_tokens = (run, meta.decode_step)

    def _read_kv(self, flat: torch.Tensor, group: _Group, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A group's keys and values, [n, Hkv, max_kv, D] each: views of the mirror's block for the layer, this
        forward's kv (cat(K, V), as written into the cache) written into it too, or gathered from the cache."""
        mirror = self._mirror
        if mirror is not None and flat.data_ptr() not in mirror.unkept:
            block = mirror.blocks.get(flat.data_ptr())
            held = block is not None
            if not held:
                block, held = mirror.gather(flat, group)  # held: rows came from a mirror of the last forward
            if held:
                if self.mirror_write is None:  # the forward's first kept layer
                    self.mirror_write = self._mirror_rows(*flat.shape[1:])
                mirror.write(block, self.mirror_write, kv)
            if block is not None:
                return mirror.views(block, group.read_shape[1])
        return flat.index_select(0, group.kv_read).view(2, *group.read_shape, *flat.shape[1:]).transpose(2, 3).unbind()

    def _mirror_rows(self, kv_heads: int, dim: int) -> torch.Tensor:
        """Where this forward's keys and values go in the mirror's blocks (a decode run's: built for all its steps
        at once)."""
        if isinstance(self._mirror_tokens[0], DecodeSteps):
            run, step = self._mirror_tokens
            if self._run_mirror_writes is None:
                self._run_mirror_writes = self._mirror.rows([1] * run.batch_size, run.positions, kv_heads, dim)
            return self._run_mirror_writes[:, step].flatten()  # [2, S, B, Hkv(, D)] -> the step's
        return self._mirror.rows(*self._mirror_tokens, kv_heads, dim).flatten()

    def _gather(self, outs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' outputs [n * q_len, H, D] -> [T, H, D] in packed order."""
        if len(outs) == 1:
            return outs[0]
        packed = torch.cat(outs)
        return torch.empty_like(packed).index_copy_(0, self.out_rows, packed)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, scale: float
    ) -> torch.Tensor:
        kv = cast(torch.cat((k, v)), kv_cache.dtype)  # [2T, Hkv, D]
        flat = write_kv(kv_cache, self.kv_write, kv)
        if self.output_rows is not None:
            q = q.index_select(0, self.output_rows)
        outs = []
        for group in self.groups:
            if group.fresh:
                out = group.unpad(F.scaled_dot_product_attention(
                    group.queries(q), group.queries(k), group.queries(v), is_causal=True, scale=scale, enable_gqa=True
                ))
            else:
                keys, values = (cast(x, q.dtype) for x in self._read_kv(flat, group, kv))  # [n, Hkv, max_kv, D]
                out = group.attend_cached(q, keys, values, scale)
            outs.append(out)
        return self._gather(outs)

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
        query_rows = torch.cat((q_latent, q_rope), dim=-1)
        if self.output_rows is not None:
            query_rows = query_rows.index_select(0, self.output_rows)
        outs = []
        for group in self.groups:
            if group.fresh:
                latent = group.queries(ckv[:, None, :])  # [n, 1, q_len, R]
                keys = torch.cat((latent, group.queries(kpe[:, None, :])), dim=-1)
                out = group.unpad(F.scaled_dot_product_attention(group.queries(query_rows), keys, latent,
                                                                 is_causal=True, scale=scale, enable_gqa=True))
            else:
                latent = ckv_flat.index_select(0, group.read_slots).view(*group.read_shape, -1).to(q_latent.dtype)
                rope_key = kpe_flat.index_select(0, group.read_slots).view(*group.read_shape, -1).to(q_latent.dtype)
                keys = torch.cat((latent, rope_key), dim=-1)[:, None]  # one head shared by all query heads
                out = group.attend_cached(query_rows, keys, latent[:, None], scale)
            outs.append(out)
        return self._gather(outs)


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
