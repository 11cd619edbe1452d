"""A batch's keys and values kept contiguous while successive forwards attend the same sequences (`KVMirror`)."""

from __future__ import annotations

import math

import torch

from infer.attention.backend import kv_rows
from infer.attention.groups import QueryGroup, matmul_attention

MIRROR_BYTES = 256 << 20  # the most a backend keeps in mirrored keys and values (KVMirror)
MIRROR_SLACK = 64  # positions a new mirror holds past the longest sequence: it is gathered anew when one outgrows it


class KVMirror:
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
        self.source: KVMirror | None = None  # the mirror this one replaced, while it has blocks to hand over (inherit)
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

    def inherit(self, old: "KVMirror") -> None:
        """Take the rows of the sequences `old` mirrors too from its blocks (`gather`), not from the pages: a batch
        whose requests end and begin a few at a time (continuous batching) copies its other rows once, contiguous,
        where a gather reads them position by position from the pages. `old` was current up to the last forward."""
        row_of = {page: row for row, page in enumerate(old.first_pages.tolist())}
        rows = [row_of.get(page, -1) for page in self.first_pages.tolist()]
        if old.blocks and max(rows) >= 0:
            self.source, self.source_rows = old, torch.tensor(rows, device=self.first_pages.device)

    def gather(self, flat: torch.Tensor, group: "QueryGroup") -> tuple[torch.Tensor | None, bool]:
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

    def _copy_rows(self, block: torch.Tensor, source: "KVMirror", old: torch.Tensor, flat: torch.Tensor,
                   group: "QueryGroup") -> str:
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

    def _from_pages(self, block: torch.Tensor, flat: torch.Tensor, group: "QueryGroup",
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
