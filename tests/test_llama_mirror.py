"""infer's Llama over the paged cache when TorchAttention keeps a batch's keys and values in a mirror (infer.attention):
every forward's logits are still transformers' (tests/test_llama.py's parity checks and helpers).

- A DecodeSteps run is planned once and writes each step into the mirror (or, past MIRROR_BYTES, gathers per step);
  a batch attending by matmul keeps its mirror transposed.
- Speculation-like forwards over one batch (rejected positions rewritten, padded queries, reused pages) gather once
  per layer; a decoding batch outgrows its mirror a logarithmic number of times; requests that end and begin take
  the others' rows from the last mirror; new memory is NaN and must not leak.
- The control: a mirror that misses its writes breaks the logits.
"""

from __future__ import annotations

import pytest
import torch

from infer import attention
from infer.attention import MIRROR_BYTES, TorchAttention
from infer.attention import groups as attn_groups
from infer.attention import mirror as attn_mirror
from infer.attention import torch_backend as attn_torch
from infer.kv_cache import DecodeSteps, PagePool, PageTable, build_page_metadata
from tests.test_llama import assert_close, concat_logits, decode_steps, random_tokens, reference_logits, run_paged

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("num_seqs", [3, attention.MATMUL_ATTENTION_MIN_SEQS], ids=["sdpa", "matmul"])
@pytest.mark.parametrize("kept_bytes", [MIRROR_BYTES, 0], ids=["kv-kept", "kv-gathered"])
@torch.no_grad()
def test_stories_decode_run_planned_once_matches_transformers(stories_model, stories_reference, monkeypatch,
                                                              kept_bytes, num_seqs):
    """A DecodeSteps run (draft forwards, plain decode runs): TorchAttention plans it on its first step (every step
    reads the keys of the last and masks the positions not yet written) and keeps each layer's gathered keys in a
    mirror, later steps writing theirs into it (or, past MIRROR_BYTES, gathers every step); each step still gives
    transformers' logits, although the cache past every sequence holds garbage. A batch that attends by matmul
    keeps its keys and values transposed in the mirror, and the run's writes land there too."""
    monkeypatch.setattr(attn_mirror, "MIRROR_BYTES", kept_bytes)
    prompt_lens, num_steps, page_size = [(5, 12, 3)[b % 3] + b // 3 for b in range(num_seqs)], 4, 4
    seqs = random_tokens(512, *(n + num_steps for n in prompt_lens), seed=5)
    pool = PagePool(256, page_size)
    caches = [c.normal_(0, 30) for c in stories_model.allocate_kv_cache(256, page_size, torch.float32, torch.device("cpu"))]
    tables = [PageTable(pool) for _ in seqs]
    for table, n in zip(tables, prompt_lens):
        table.extend(n + num_steps)
    attn = TorchAttention()
    prefill = build_page_metadata([t.pages for t in tables], prompt_lens, prompt_lens, page_size, torch.device("cpu"))
    attn.plan(prefill)
    logits = [stories_model(torch.cat([s[:n] for s, n in zip(seqs, prompt_lens)]), prefill.positions, attn, caches)
              .logits.split(prompt_lens)]
    run = DecodeSteps([t.pages for t in tables], prompt_lens, num_steps, page_size, torch.device("cpu"))
    for j in range(num_steps):
        meta = run.step(j)
        attn.plan(meta)
        ids = torch.stack([s[n + j] for s, n in zip(seqs, prompt_lens)])
        logits.append(stories_model(ids, meta.positions, attn, caches).logits.split(1))
    assert len(attn._mirror.blocks) == (len(caches) if kept_bytes else 0)  # the path under test was taken
    transposed = num_seqs >= attention.MATMUL_ATTENTION_MIN_SEQS if kept_bytes else None  # None: nothing kept
    assert attn._mirror.transposed is transposed
    for b, tokens in enumerate(seqs):
        assert_close(torch.cat([step[b] for step in logits]), reference_logits(stories_reference, tokens))


def count_mirror_gathers(monkeypatch) -> dict[str, int]:
    """{"n": how many times a layer has gathered its keys from the cache into a mirror}, counted from now on."""
    gathers = {"n": 0}
    gather = attention.KVMirror.gather

    def counted(mirror, flat, group):
        gathers["n"] += 1
        return gather(mirror, flat, group)

    monkeypatch.setattr(attention.KVMirror, "gather", counted)
    return gathers


def record_copy_paths(monkeypatch) -> list[str]:
    """How each new mirror block took its rows from the last mirror's (`KVMirror._copy_rows`), in order."""
    paths = []
    copy_rows = attention.KVMirror._copy_rows
    monkeypatch.setattr(attention.KVMirror, "_copy_rows", lambda *args: paths.append(copy_rows(*args)) or paths[-1])
    return paths


def record_page_reads(monkeypatch) -> list[int]:
    """How many slots each read from the pages asked for (`kv_rows`), in order; a test clears it between forwards."""
    read = []
    kv_rows = attention.kv_rows
    for module in (attn_groups, attn_mirror):  # the group's read plan and a mirror's rows gathered for some sequences
        monkeypatch.setattr(module, "kv_rows", lambda slots, page_size: read.append(slots.numel()) or
                            kv_rows(slots, page_size))
    return read


def new_memory_is_nan(monkeypatch) -> None:
    """Every `new_empty` tensor starts filled with NaN: what a mirror's block holds unwritten must not leak."""
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *args, **kwargs:
                        new_empty(self, *args, **kwargs).fill_(float("nan")))


def run_speculative_like(model, reference, monkeypatch, write_mirror: bool) -> int:
    """Forwards over one batch as speculation runs them: verify-like steps of 3 tokens per sequence that accept a
    random share (the rejected positions are rewritten by the next step with other tokens), catch-up-like steps of
    1-3 tokens (a padded group); halfway, the first sequence finishes and a new one takes its pages (the same first
    page) and prefills. Every forward's logits are checked against transformers on the sequence's tokens so far;
    returns how many times a layer gathered its keys from the cache into a mirror."""
    gathers = count_mirror_gathers(monkeypatch)
    if not write_mirror:
        rows = attention.KVMirror.rows  # every write lands on row 0: the mirror goes stale
        monkeypatch.setattr(attention.KVMirror, "rows", lambda *args: torch.zeros_like(rows(*args)))
    rng = torch.Generator().manual_seed(7)
    page_size, num_pages = 4, 64
    pool = PagePool(num_pages, page_size)
    caches = model.allocate_kv_cache(num_pages, page_size, torch.float32, torch.device("cpu"))
    tables = [PageTable(pool) for _ in range(3)]
    tokens = [torch.randint(3, 512, (n,), generator=rng) for n in (5, 9, 2)]  # settled tokens of each sequence
    attn = TorchAttention()

    def forward(chunks: list[torch.Tensor]) -> None:
        q_lens = [len(c) for c in chunks]
        for table, seq, q_len in zip(tables, tokens, q_lens):
            table.extend(len(seq) + q_len)
        kv_lens = [len(seq) + q for seq, q in zip(tokens, q_lens)]
        meta = build_page_metadata([t.pages for t in tables], q_lens, kv_lens, page_size, torch.device("cpu"))
        attn.plan(meta)
        logits = model(torch.cat(chunks), meta.positions, attn, caches).logits.split(q_lens)
        assert (attn._mirror is not None) == any(len(seq) for seq in tokens)  # every forward over the cache reads one
        for seq, chunk, out in zip(tokens, chunks, logits):
            assert_close(out, reference_logits(reference, torch.cat((seq, chunk)))[-len(chunk):])

    prompts, tokens = tokens, [seq[:0] for seq in tokens]
    forward(prompts)  # the prefill: a fresh forward over the prompts alone
    tokens = prompts
    for step in range(12):
        if step == 6:  # the first sequence ends; a new one gets its pages, first page first, and prefills 4 tokens
            first_page = tables[0].pages[0]
            pool.release(tables[0].pages[::-1])
            tables[0], tokens[0] = PageTable(pool), tokens[0][:0]
            chunks = [torch.randint(3, 512, (n,), generator=rng) for n in (4, 1, 1)]
            forward(chunks)  # one padded group of short queries, beside the others' decodes
            assert tables[0].pages[0] == first_page
            tokens = [torch.cat((seq, chunk)) for seq, chunk in zip(tokens, chunks)]
            continue
        q_lens = [3] * 3 if step % 2 == 0 else [int(torch.randint(1, 4, (1,), generator=rng)) for _ in tokens]
        chunks = [torch.randint(3, 512, (q,), generator=rng) for q in q_lens]
        forward(chunks)
        for b, chunk in enumerate(chunks):  # accept a prefix; the rest is rewritten by the next forward
            accepted = int(torch.randint(1, len(chunk) + 1, (1,), generator=rng))
            tokens[b] = torch.cat((tokens[b], chunk[:accepted]))
            tables[b].truncate(len(tokens[b]))
    return gathers["n"]


@pytest.mark.parametrize("new_memory, transposed", [("as-is", False), ("nan", False), ("nan", True)],
                         ids=["as-is", "nan", "nan-matmul"])
@torch.no_grad()
def test_stories_forwards_over_one_batch_read_a_mirror_and_match_transformers(stories_model, stories_reference,
                                                                              monkeypatch, new_memory, transposed):
    """TorchAttention keeps the keys of a batch its forwards keep attending (speculation's verify forwards and
    catch-ups) in a mirror that every forward writes into: it is gathered once per layer, not per forward, and every
    logit is transformers' though positions are rejected and rewritten, queries padded and pages reused. A block is
    allocated uninitialized: with NaN in every new one, the positions past the gathered ones, which shorter sequences
    read masked as the longest grows (a NaN would leak through a zero weight), must come out zeroed."""
    if new_memory == "nan":
        new_memory_is_nan(monkeypatch)
    if transposed:  # the batched-matmul path and its mirror layout (transposed), at this batch of 3
        monkeypatch.setattr(attn_groups, "MATMUL_ATTENTION_MIN_SEQS", 1)
    gathers = run_speculative_like(stories_model, stories_reference, monkeypatch, write_mirror=True)
    assert gathers == len(stories_model.model.layers)  # one gather per layer, at the first forward over the cache


@pytest.mark.parametrize("doubling, transposed", [(True, False), (True, True), (False, False)],
                         ids=["doubling", "doubling-matmul", "control-by-slack"])
@torch.no_grad()
def test_stories_a_decoding_batch_outgrows_its_mirror_a_logarithmic_number_of_times(stories_model, stories_reference,
                                                                                    monkeypatch, doubling,
                                                                                    transposed):
    """A batch that keeps decoding outgrows its mirror: each time, it is rebuilt at twice the longest sequence,
    so 120 steps past a mirror of 4 slack positions regather every layer 4 times, not 30, and every logit is still
    transformers'. The control grows by the slack alone (the rule before), and the count leaves the bound. A new
    block takes the rows from the last one by slices, reading nothing from the pages, and zeroes what lies past them
    (new memory NaN)."""
    monkeypatch.setattr(attn_torch, "MIRROR_SLACK", 4)
    if transposed:  # the batched-matmul path and its mirror layout, at this batch of 2
        monkeypatch.setattr(attn_groups, "MATMUL_ATTENTION_MIN_SEQS", 1)
    new_memory_is_nan(monkeypatch)
    paths = record_copy_paths(monkeypatch)
    read = record_page_reads(monkeypatch)
    if not doubling:
        keep = attention.TorchAttention._keep_mirror

        def by_slack(self, meta, max_kv):
            if self._mirror is not None and max_kv > self._mirror.capacity:
                self._mirror = None  # as a new batch: slack only
            return keep(self, meta, max_kv)

        monkeypatch.setattr(attention.TorchAttention, "_keep_mirror", by_slack)
    gathers = count_mirror_gathers(monkeypatch)
    prompt_lens = [5, 9]
    seqs = random_tokens(512, *(n + 120 for n in prompt_lens), seed=11)
    results = run_paged(stories_model, decode_steps(seqs, prompt_lens), page_size=4)
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(stories_reference, tokens))
    layers = len(stories_model.model.layers)
    # capacities (pages of 4): 16, then twice the longest at each outgrowing: 34 -> 36, 74 -> 76, 154 -> 156
    assert (gathers["n"] == 4 * layers) == doubling, gathers["n"] // layers
    if doubling:  # the first mirror gathered from the pages (one read plan for every layer), the others from the last
        assert paths == ["in order"] * 3 * layers and len(read) == 1


@pytest.mark.parametrize("transposed", [False, True], ids=["sdpa", "matmul"])
@torch.no_grad()
def test_stories_requests_that_end_and_begin_take_the_others_rows_from_the_last_mirror(stories_model,
                                                                                      stories_reference,
                                                                                      monkeypatch, transposed):
    """Continuous batching: a request ends and another joins at the batch's end, then one joins at its front. Each
    new mirror takes the rows of the sequences the last one held from that mirror's blocks (whole rows when they lead
    the batch at the same capacity, position by position otherwise) and reads only the newcomer's from the pages;
    the old mirror is let go; every logit is transformers', with every new block's memory NaN (what a row holds past
    its sequence must come out zeroed)."""
    if transposed:  # the batched-matmul path and its mirror layout, at these few sequences
        monkeypatch.setattr(attn_groups, "MATMUL_ATTENTION_MIN_SEQS", 1)
    new_memory_is_nan(monkeypatch)
    read = record_page_reads(monkeypatch)
    paths = record_copy_paths(monkeypatch)
    page_size, layers = 4, len(stories_model.model.layers)
    pool = PagePool(64, page_size)
    caches = stories_model.allocate_kv_cache(64, page_size, torch.float32, torch.device("cpu"))
    attn = TorchAttention()
    rng = torch.Generator().manual_seed(3)
    live: dict[str, tuple[PageTable, torch.Tensor]] = {}

    def forward(lengths: dict[str, int]) -> int:
        """One forward: `lengths` new tokens for each named sequence, in this order (a new name joins); returns the
        longest sequence after it."""
        read.clear()
        chunks = {name: torch.randint(3, 512, (n,), generator=rng) for name, n in lengths.items()}
        for name, chunk in chunks.items():
            table, tokens = live.setdefault(name, (PageTable(pool), chunk[:0]))
            table.extend(len(tokens) + len(chunk))
        q_lens = [len(chunk) for chunk in chunks.values()]
        kv_lens = [len(live[name][1]) + q for name, q in zip(chunks, q_lens)]
        meta = build_page_metadata([live[name][0].pages for name in chunks], q_lens, kv_lens, page_size,
                                   torch.device("cpu"))
        attn.plan(meta)
        logits = stories_model(torch.cat(list(chunks.values())), meta.positions, attn, caches).logits.split(q_lens)
        for (name, chunk), out in zip(chunks.items(), logits):
            tokens = torch.cat((live[name][1], chunk))
            live[name] = (live[name][0], tokens)
            assert_close(out, reference_logits(stories_reference, tokens)[-len(chunk):])
        return max(kv_lens)

    forward({"a": 5, "b": 9, "c": 2})  # a fresh prefill: no mirror
    forward({"a": 1, "b": 1, "c": 1})  # the first mirror, gathered from the pages
    live.pop("a")[0].free()
    longest = forward({"b": 1, "c": 1, "d": 3})  # a ended, d joins at the end
    assert paths == ["whole rows"] * layers and read == [longest] * layers  # d's rows alone from the pages
    forward({"b": 1, "c": 1, "d": 1})
    paths.clear()
    longest = forward({"e": 2, "b": 1, "c": 1, "d": 1})  # e joins at the front
    assert paths == ["by position"] * layers and read == [longest] * layers
    assert attn._mirror.source is None  # every layer took its rows: the old mirror is gone
    forward({"e": 1, "b": 1, "c": 1, "d": 1})


@torch.no_grad()
def test_stories_mirror_that_misses_writes_breaks_the_logits(stories_model, stories_reference, monkeypatch):
    """The control: a mirror whose writes land elsewhere serves stale keys, and the logits leave transformers'."""
    with pytest.raises(AssertionError, match="reference range"):
        run_speculative_like(stories_model, stories_reference, monkeypatch, write_mirror=False)


@torch.no_grad()
def test_stories_many_sequences_attend_by_matmul_over_the_mirror_and_match_transformers(stories_model,
                                                                                      stories_reference, monkeypatch):
    """Decodes and verify-like rows of MATMUL_ATTENTION_MIN_SEQS or more sequences over a mirror take the batched
    matmul-softmax path (SDPA serves only the prefill) over keys the mirror keeps transposed, and every sequence's
    logits are transformers'."""
    sdpa_calls = {"n": 0}
    sdpa, attend = torch.nn.functional.scaled_dot_product_attention, attn_groups.attention
    key_strides = []

    def counted(*args, **kwargs):
        sdpa_calls["n"] += 1
        return sdpa(*args, **kwargs)

    def attend_noting_keys(q, keys, *args):
        key_strides.append(keys.stride(-2))
        return attend(q, keys, *args)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    monkeypatch.setattr(attn_groups, "attention", attend_noting_keys)
    prompt_lens = [5 + i % 4 for i in range(attention.MATMUL_ATTENTION_MIN_SEQS)]  # one prefill group
    seqs = random_tokens(512, *(n + 9 for n in prompt_lens), seed=8)
    steps = decode_steps(seqs, prompt_lens)[:4]  # the prefill, then three decode steps
    steps.append([seq[n + 3 : n + 9] for seq, n in zip(seqs, prompt_lens)])  # then 6 rows each (verify-like)
    results = run_paged(stories_model, steps, page_size=4, num_pages=256)
    assert sdpa_calls["n"] == len(stories_model.model.layers)  # the prefill's causal SDPA, one group, only
    assert key_strides and set(key_strides) == {1}  # every cached read: keys transposed, positions contiguous
    for b, tokens in enumerate(seqs):
        assert_close(concat_logits(results, b), reference_logits(stories_reference, tokens))
