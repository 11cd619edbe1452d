"""The paged KV cache: a pool of fixed-size pages shared by every sequence (and by target and drafter).

Pages are handed out by `PagePool`, reference counted so that sequences can share a prefix. A sequence's
pages are listed in its `PageTable`; `build_page_metadata` turns a batch of page tables into FlashInfer's
layout (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), which every attention backend consumes.
The KV tensors themselves belong to the models (`model.allocate_kv_cache`), all indexed by the same pages.
"""

from __future__ import annotations

import array
import itertools
from dataclasses import dataclass, field

import torch

from infer.device_copy import to_device


class OutOfPages(RuntimeError):
    """The pool cannot satisfy an allocation; the scheduler preempts instead of crashing."""


class PagePool:
    """Allocator over `num_pages` page ids with reference counts (a page is free at count 0)."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages} and {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refcount = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free of {self.num_pages}")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def share(self, pages: list[int]) -> None:
        """Add a reference to pages already held (a shared prefix)."""
        for p in pages:
            if self._refcount[p] == 0:
                raise ValueError(f"page {p} is free and cannot be shared")
            self._refcount[p] += 1

    def release(self, pages: list[int]) -> None:
        for p in pages:
            if self._refcount[p] <= 0:
                raise ValueError(f"page {p} released more times than it was allocated")
            self._refcount[p] -= 1
            if self._refcount[p] == 0:
                self._free.append(p)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass
class PageTable:
    """The pages holding one sequence's KV, in order, and how many token slots are in use."""

    pool: PagePool
    pages: list[int] = field(default_factory=list)
    num_tokens: int = 0

    def pages_to_grow(self, num_tokens: int) -> int:
        """Pages that `extend` to `num_tokens` would allocate."""
        return max(0, pages_needed(num_tokens, self.pool.page_size) - len(self.pages))

    def extend(self, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens in all (allocating pages); raises OutOfPages, changing nothing."""
        grow = self.pages_to_grow(num_tokens)
        if grow:
            self.pages.extend(self.pool.allocate(grow))
        self.num_tokens = max(self.num_tokens, num_tokens)

    def truncate(self, num_tokens: int) -> None:
        """Keep the first `num_tokens` tokens (rollback of rejected draft tokens); frees pages past them."""
        keep = pages_needed(num_tokens, self.pool.page_size)
        if keep < len(self.pages):
            self.pool.release(self.pages[keep:])
            del self.pages[keep:]
        self.num_tokens = min(self.num_tokens, num_tokens)

    def free(self) -> None:
        self.pool.release(self.pages)
        self.pages = []
        self.num_tokens = 0


@dataclass
class PageMetadata:
    """One step's page tables in FlashInfer's layout plus where each new token's KV is written.

    For B sequences with q_len[b] new tokens each (appended after kv_len[b] - q_len[b] cached ones):
      qo_indptr        [B+1] int32  offsets of each sequence's new tokens in the packed batch
      kv_indptr        [B+1] int32  offsets of each sequence's pages in kv_indices
      kv_indices       [sum pages] int32
      kv_last_page_len [B]   int32  tokens used in each sequence's last page (1..page_size)
      kv_lens          [B]   int32  KV length after this step's tokens are appended
      positions        [T]   int64  position of every new token
      slot_mapping     [T]   int64  page * page_size + offset where every new token's KV goes
      cache_rows       [2T]  int64  the rows of a [pages, 2, page_size, ...] cache's flat view where the new tokens'
                                    K go, then their V (`infer.attention.kv_rows` of slot_mapping, listed with it)
    A step of a `DecodeSteps` run names it (decode_run, decode_step): a backend may plan the whole run at once.
    A step may want one output per sequence (output_rows, [B] rows of the packed batch, each attending at its own
    position); a backend that computes those rows alone says so in its own `output_rows`.
    The fields are built on the host; on another device `host` keeps them there (`on_host`).
    """

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cache_rows: torch.Tensor
    page_size: int
    max_q_len: int
    max_kv_len: int
    decode_run: DecodeSteps | None = field(default=None, repr=False, compare=False)
    decode_step: int = 0
    # Only these rows attend, one per sequence (its last row, or any row: keys up to its position): every token's
    # K/V is written, and a one-layer head's forward computes its outputs there alone (its catch-up's carry; a model
    # of more layers needs every row's output). None: every row.
    output_rows: torch.Tensor | None = None
    host: PageMetadata | None = field(default=None, repr=False, compare=False)

    def on_host(self) -> PageMetadata:
        """These fields on the CPU, as they were built: what a plan reads without a device sync (FlashInfer's
        plan() copies device indptrs back to the host, a blocking copy per forward, prefill.py at fb28d72)."""
        return self if self.host is None else self.host

    @property
    def batch_size(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


def build_page_metadata(
    page_lists: list[list[int]], q_lens: list[int], kv_lens: list[int], page_size: int, device: torch.device
) -> PageMetadata:
    """Batch the page tables of one step in Python, touching each sequence and each page of its new tokens once
    (never each token: ranges are extended in C), into two buffers cut into the fields: at decode batch sizes the
    two dozen small tensor ops that would compute positions and slots on tensors cost more than these lists."""
    used = [pages_needed(kv_len, page_size) for kv_len in kv_lens]  # pages covering each sequence's kv
    kv_indices = list(itertools.chain.from_iterable(pages[:n] for pages, n in zip(page_lists, used)))
    if max(q_lens) == 1:  # decodes: the one new token sits at kv_len - 1
        positions = [kv_len - 1 for kv_len in kv_lens]
        page_offsets = [(pages[pos // page_size], pos % page_size) for pages, pos in zip(page_lists, positions)]
        slots = [page * page_size + offset for page, offset in page_offsets]
        k_rows = [2 * page * page_size + offset for page, offset in page_offsets]
    else:
        positions, slots, k_rows = [], [], []
        for pages, q_len, kv_len in zip(page_lists, q_lens, kv_lens):
            first = kv_len - q_len  # slot = pages[pos // page_size] * page_size + pos % page_size, page by page
            positions.extend(range(first, kv_len))
            for page in range(first // page_size, (kv_len - 1) // page_size + 1):
                start, end = max(first, page * page_size), min(kv_len, (page + 1) * page_size)
                shift = (pages[page] - page) * page_size
                slots.extend(range(shift + start, shift + end))
                k_shift = (2 * pages[page] - page) * page_size  # K rows: page p's rows start at 2p * page_size
                k_rows.extend(range(k_shift + start, k_shift + end))
    # Two buffers (torch.tensor walks a list element by element, several times slower than array): the int32 indices
    # and the int64 positions, slots and cache rows, each cut into views (an int32 buffer, not a cast of an int64 one,
    # which costs the build more). The tensors share (and keep alive) the arrays. The cache rows are listed here, where
    # the five tensor ops of kv_rows would cost a forward's plan more.
    index_fields = ([0, *itertools.accumulate(q_lens)], [0, *itertools.accumulate(used)], kv_indices,
                    [kv_len - (n - 1) * page_size for kv_len, n in zip(kv_lens, used)], kv_lens)
    flat32 = torch.frombuffer(array.array("i", itertools.chain(*index_fields)), dtype=torch.int32)
    flat64 = torch.frombuffer(array.array("q", itertools.chain(positions, slots, k_rows,
                                                               (row + page_size for row in k_rows))), dtype=torch.int64)

    def cut(flat32: torch.Tensor, flat64: torch.Tensor) -> PageMetadata:
        qo_indptr, kv_indptr, kv_indices_t, last_page_len, kv_lens_t = flat32.split_with_sizes(
            [len(f) for f in index_fields])
        positions_t, slots_t, cache_rows = flat64.split_with_sizes([len(positions), len(slots), 2 * len(slots)])
        return PageMetadata(
            qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices_t, kv_last_page_len=last_page_len,
            kv_lens=kv_lens_t, positions=positions_t, slot_mapping=slots_t, cache_rows=cache_rows,
            page_size=page_size, max_q_len=max(q_lens),
            max_kv_len=max(kv_lens),
        )

    host = cut(flat32, flat64)
    if torch.device(device).type == "cpu":
        return host
    meta = cut(to_device(flat32, device), to_device(flat64, device))  # two copies to the device, async
    meta.host = host
    return meta


class DecodeSteps:
    """The metadata of successive one-token forwards over fixed page tables, built once for all of them.

    Draft forwards are such a run, and so are the plain decode steps of a batch that does not change (the engine's
    decode runs): step j writes position first[b] + j of every sequence, so positions advance by one and kv lengths
    follow. Every step's fields are listed here in one pass, each step's laid out one after another in two buffers
    (as in `build_page_metadata`, without a host read) and cut by one split per buffer, so that `step(j)` only picks
    its pieces: a run of one or two draft forwards is built as cheaply as one step's metadata. The run's kv lengths and
    positions also come whole ([S, B], S steps) for a backend that plans the run at once. Each step equals what
    `build_page_metadata` gives for it.
    """

    def __init__(self, page_lists: list[list[int]], first_positions: list[int], num_steps: int, page_size: int,
                 device: torch.device) -> None:
        batch = len(first_positions)
        steps32: list[list[int]] = []  # per step: kv_indptr, kv_last_page_len, kv_lens, kv_indices
        steps64: list[list[int]] = []  # per step: positions, slot_mapping, cache_rows
        for j in range(num_steps):
            positions = [first + j for first in first_positions]
            used = [pos // page_size + 1 for pos in positions]  # pages covering kv_len = pos + 1
            page_offsets = [(pages[pos // page_size], pos % page_size) for pages, pos in zip(page_lists, positions)]
            k_rows = [2 * page * page_size + offset for page, offset in page_offsets]
            steps32 += ([0, *itertools.accumulate(used)], [offset + 1 for _, offset in page_offsets],
                        [pos + 1 for pos in positions],
                        list(itertools.chain.from_iterable(pages[:n] for pages, n in zip(page_lists, used))))
            steps64 += (positions, [page * page_size + offset for page, offset in page_offsets],
                        k_rows + [row + page_size for row in k_rows])
        # the buffers: qo_indptr (shared by the steps) and the run's kv lengths, then each step's fields; the run's
        # positions, then each step's
        fields32 = [list(range(batch + 1)), [kv for step in steps32[2::4] for kv in step], *steps32]
        fields64 = [[pos for step in steps64[0::3] for pos in step], *steps64]
        flat32 = torch.frombuffer(array.array("i", itertools.chain(*fields32)), dtype=torch.int32)
        flat64 = torch.frombuffer(array.array("q", itertools.chain(*fields64)), dtype=torch.int64)
        sizes32, sizes64 = [len(f) for f in fields32], [len(f) for f in fields64]

        def cut(flat32: torch.Tensor, flat64: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            return flat32.split_with_sizes(sizes32), flat64.split_with_sizes(sizes64)

        self._host = cut(flat32, flat64)
        on_cpu = torch.device(device).type == "cpu"
        self._fields = self._host if on_cpu else cut(to_device(flat32, device), to_device(flat64, device))
        pieces32, pieces64 = self._fields
        self.kv_lens = pieces32[1].view(num_steps, batch)  # [S, B]
        self.positions = pieces64[0].view(num_steps, batch)  # [S, B]
        self.first_max, self.page_size, self.num_steps, self.batch_size = (max(first_positions), page_size, num_steps,
                                                                           batch)

    def step(self, j: int) -> PageMetadata:
        meta = self._step(self._fields, j)
        if self._fields is not self._host:
            meta.host = self._step(self._host, j)
        return meta

    def _step(self, fields: tuple[list[torch.Tensor], list[torch.Tensor]], j: int) -> PageMetadata:
        pieces32, pieces64 = fields
        kv_indptr, last_page_len, kv_lens, kv_indices = pieces32[2 + 4 * j : 6 + 4 * j]
        positions, slots, cache_rows = pieces64[1 + 3 * j : 4 + 3 * j]
        return PageMetadata(
            qo_indptr=pieces32[0], kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=last_page_len,
            kv_lens=kv_lens, positions=positions, slot_mapping=slots, cache_rows=cache_rows, page_size=self.page_size,
            max_q_len=1, max_kv_len=self.first_max + j + 1, decode_run=self, decode_step=j,
        )
