"""The paged KV cache's bookkeeping: page refcounts, page tables, and FlashInfer's batch layout."""

from __future__ import annotations

import random

import pytest
import torch

from infer.kv_cache import DecodeSteps, OutOfPages, PagePool, PageTable, build_page_metadata, pages_needed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CPU = torch.device("cpu")


# --- PagePool -----------------------------------------------------------------------------------------------------


def test_allocate_hands_out_distinct_pages_until_empty():
    pool = PagePool(num_pages=5, page_size=4)
    first = pool.allocate(2)
    second = pool.allocate(3)
    assert len(set(first + second)) == 5 and set(first + second) == set(range(5))
    assert pool.num_free == 0
    with pytest.raises(OutOfPages):
        pool.allocate(1)
    assert pool.allocate(0) == []


def test_out_of_pages_leaves_the_pool_unchanged():
    pool = PagePool(num_pages=6, page_size=4)
    held = pool.allocate(4)
    with pytest.raises(OutOfPages, match="need 3 pages, 2 free"):
        pool.allocate(3)
    assert pool.num_free == 2
    rest = pool.allocate(2)  # the two pages that were free before the failed call are still there
    assert sorted(held + rest) == list(range(6))


def test_shared_page_is_free_only_after_every_holder_releases_it():
    pool = PagePool(num_pages=4, page_size=4)
    pages = pool.allocate(2)
    pool.share(pages[:1])  # a second sequence shares the first page (a common prefix)
    pool.release(pages)  # the first holder lets go of both
    assert pool.num_free == 3  # pages[1] is back, pages[0] is still held by the sharer
    assert pages[0] not in pool.allocate(3)
    pool.release(pages[:1])
    assert pool.num_free == 1 and pool.allocate(1) == pages[:1]


def test_double_release_raises():
    pool = PagePool(num_pages=3, page_size=4)
    pages = pool.allocate(2)
    pool.release(pages)
    with pytest.raises(ValueError, match="released more times"):
        pool.release(pages[:1])
    assert pool.num_free == 3


def test_sharing_a_free_page_raises():
    pool = PagePool(num_pages=3, page_size=4)
    with pytest.raises(ValueError, match="free"):
        pool.share([1])


@pytest.mark.parametrize("num_pages, page_size", [(0, 4), (4, 0), (-1, 16)])
def test_pool_rejects_empty_sizes(num_pages, page_size):
    with pytest.raises(ValueError):
        PagePool(num_pages, page_size)


def test_pages_needed_is_ceil_division():
    assert [pages_needed(n, 4) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]


# --- PageTable ----------------------------------------------------------------------------------------------------


def test_extend_allocates_a_page_exactly_when_a_boundary_is_crossed():
    pool = PagePool(num_pages=8, page_size=4)
    table = PageTable(pool)
    pages_after = []
    for num_tokens in range(1, 14):
        table.extend(num_tokens)
        pages_after.append(len(table.pages))
        assert table.num_tokens == num_tokens
    assert pages_after == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4]
    assert pool.num_free == 8 - 4
    table.extend(6)  # extending to fewer tokens than held changes nothing
    assert len(table.pages) == 4 and table.num_tokens == 13
    assert table.pages_to_grow(16) == 0 and table.pages_to_grow(17) == 1 and table.pages_to_grow(30) == 4


def test_extend_out_of_pages_changes_nothing():
    pool = PagePool(num_pages=3, page_size=4)
    table = PageTable(pool)
    table.extend(6)
    pages = list(table.pages)
    with pytest.raises(OutOfPages):
        table.extend(13)  # needs 4 pages, the pool has 3
    assert table.pages == pages and table.num_tokens == 6 and pool.num_free == 1


def test_truncate_frees_whole_pages_past_the_kept_tokens():
    pool = PagePool(num_pages=8, page_size=4)
    table = PageTable(pool)
    table.extend(10)  # 3 pages, the last holding 2 tokens
    first_pages = list(table.pages)
    table.truncate(9)  # still 3 pages
    assert table.pages == first_pages and table.num_tokens == 9 and pool.num_free == 5
    table.truncate(8)  # exactly 2 full pages
    assert table.pages == first_pages[:2] and table.num_tokens == 8 and pool.num_free == 6
    table.truncate(5)
    assert table.pages == first_pages[:2] and table.num_tokens == 5
    table.truncate(4)
    assert table.pages == first_pages[:1] and pool.num_free == 7
    table.extend(7)  # grow again after a rollback
    assert len(table.pages) == 2 and table.num_tokens == 7 and pool.num_free == 6
    table.truncate(0)
    assert table.pages == [] and table.num_tokens == 0 and pool.num_free == 8


def test_free_returns_every_page_and_shared_prefixes_survive():
    pool = PagePool(num_pages=6, page_size=4)
    parent = PageTable(pool)
    parent.extend(10)  # 3 pages
    child = PageTable(pool, pages=parent.pages[:2], num_tokens=8)
    pool.share(child.pages)
    child.extend(11)  # the child grows its own third page
    assert child.pages[:2] == parent.pages[:2] and child.pages[2] != parent.pages[2]
    assert pool.num_free == 2
    parent.free()
    assert parent.pages == [] and parent.num_tokens == 0
    assert pool.num_free == 3  # only the parent's own last page came back
    child.free()
    assert pool.num_free == 6
    parent.free()  # freeing an empty table is harmless
    assert pool.num_free == 6


# --- build_page_metadata ------------------------------------------------------------------------------------------


def test_page_metadata_hand_worked_example():
    """page_size 4, three sequences in one step:
    A: prefill of 6 tokens into pages [5, 2]                      -> positions 0..5
    B: decode of 1 token, 2 cached, page [7]                      -> position 2
    C: chunk of 3 tokens after 9 cached, pages [0, 3, 9, 1]       -> positions 9..11 (page 1 not yet used)
    """
    meta = build_page_metadata([[5, 2], [7], [0, 3, 9, 1]], q_lens=[6, 1, 3], kv_lens=[6, 3, 12], page_size=4, device=CPU)
    assert meta.qo_indptr.tolist() == [0, 6, 7, 10]
    assert meta.kv_indptr.tolist() == [0, 2, 3, 6]
    assert meta.kv_indices.tolist() == [5, 2, 7, 0, 3, 9]
    assert meta.kv_last_page_len.tolist() == [2, 3, 4]
    assert meta.kv_lens.tolist() == [6, 3, 12]
    assert meta.positions.tolist() == [0, 1, 2, 3, 4, 5, 2, 9, 10, 11]
    # A: page 5 slots 20..23, then page 2 slots 8, 9; B: page 7 offset 2; C: page 9 offsets 1..3.
    assert meta.slot_mapping.tolist() == [20, 21, 22, 23, 8, 9, 30, 37, 38, 39]
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len"):
        assert getattr(meta, name).dtype == torch.int32, name  # FlashInfer's index dtype
    assert meta.positions.dtype == torch.int64 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_q_len, meta.max_kv_len, meta.batch_size, meta.num_tokens, meta.page_size) == (6, 12, 3, 10, 4)


def reference_metadata(page_lists, q_lens, kv_lens, page_size):
    """Token by token, from the definitions."""
    qo_indptr, kv_indptr, kv_indices, last, positions, slots = [0], [0], [], [], [], []
    for pages, q_len, kv_len in zip(page_lists, q_lens, kv_lens):
        used = -(-kv_len // page_size)
        kv_indices += pages[:used]
        kv_indptr.append(len(kv_indices))
        qo_indptr.append(qo_indptr[-1] + q_len)
        last.append(kv_len - (used - 1) * page_size)
        for pos in range(kv_len - q_len, kv_len):
            positions.append(pos)
            slots.append(pages[pos // page_size] * page_size + pos % page_size)
    return qo_indptr, kv_indptr, kv_indices, last, positions, slots


@pytest.mark.parametrize("page_size", [1, 3, 4, 16])
def test_page_metadata_matches_a_per_token_reference(page_size):
    rng = random.Random(page_size)
    pool = PagePool(num_pages=400, page_size=page_size)
    tables, q_lens = [], []
    for _ in range(7):
        table = PageTable(pool)
        cached = rng.choice([0, 0, 1, page_size - 1, page_size, 2 * page_size + 1, rng.randrange(40)])
        q_len = rng.choice([1, 1, 2, page_size, page_size + 1, rng.randrange(1, 30)])
        table.extend(cached)
        pool.allocate(rng.randrange(3))  # other sequences' pages interleave: tables are not contiguous
        table.extend(cached + q_len)
        tables.append(table)
        q_lens.append(q_len)
    page_lists = [t.pages + [399] for t in tables]  # a spare page past kv_len must be ignored
    kv_lens = [t.num_tokens for t in tables]
    meta = build_page_metadata(page_lists, q_lens, kv_lens, page_size, CPU)
    qo_indptr, kv_indptr, kv_indices, last, positions, slots = reference_metadata(page_lists, q_lens, kv_lens, page_size)
    assert meta.qo_indptr.tolist() == qo_indptr
    assert meta.kv_indptr.tolist() == kv_indptr
    assert meta.kv_indices.tolist() == kv_indices
    assert meta.kv_last_page_len.tolist() == last
    assert all(1 <= n <= page_size for n in last)
    assert meta.positions.tolist() == positions
    assert meta.slot_mapping.tolist() == slots
    assert len(set(slots)) == len(slots)  # no two new tokens write the same slot
    # the cache rows: K of slot s at 2 * (s // page_size) * page_size + s % page_size, its V a page_size further
    k_rows = [2 * (s // page_size) * page_size + s % page_size for s in slots]
    assert meta.cache_rows.tolist() == k_rows + [r + page_size for r in k_rows]


# --- DecodeSteps ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_decode_steps_equal_a_fresh_build_at_every_step(page_size):
    """The draft forwards' metadata, built once and advanced on the device, is exactly build_page_metadata's for each
    step, page-boundary crossings included (sequences start at every offset within a page)."""
    rng = random.Random(page_size)
    steps = 5
    firsts = [rng.randrange(0, 40) for _ in range(9)] + [page_size - 1, page_size, 0]
    pool = PagePool(num_pages=1000, page_size=page_size)
    tables = [PageTable(pool) for _ in firsts]
    for table, first in zip(tables, firsts):
        table.extend(first + steps)
    page_lists = [t.pages for t in tables]
    plan = DecodeSteps(page_lists, firsts, steps, page_size, CPU)
    for j in range(steps):
        got = plan.step(j)
        want = build_page_metadata(page_lists, [1] * len(firsts), [f + j + 1 for f in firsts], page_size, CPU)
        for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "kv_lens", "positions",
                     "slot_mapping", "cache_rows"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (j, name, a, b)
        assert (got.max_q_len, got.max_kv_len, got.page_size) == (want.max_q_len, want.max_kv_len, want.page_size)
