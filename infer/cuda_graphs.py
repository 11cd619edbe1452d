"""Forwards of uniform rows replayed from CUDA graphs: plain decode (1 row a request), verify (K+1 rows a request) and
a drafter's catch-up and drafts, each captured per padded batch size.

The design follows SGLang's `cuda_graph_runner.py` (sgl-project/sglang 21514ff, python/sglang/srt/model_executor)
and vLLM's padded capture sizes: static max-size buffers for the inputs (token ids, positions, the cache rows each
token writes, a block table of page ids, the rows whose logits are wanted, a head's hidden states), each graph
captured on `[:bs]` views of them, the step's inputs copied in before a replay, padded requests' rows writing their
K/V to a reserved dummy page (page `num_pages` of a cache allocated one page larger) and attending only to it.
Attention is FlashInfer's on that backend (`FlashInferGraphAttention`: a `use_cuda_graph=True` wrapper per padded
batch size and rows a request over fixed metadata buffers, planned on the host from host copies before every
replay), else `StaticPagedAttention`, whose fixed-shape metadata a graph can hold (torch SDPA). A forward is
replayed when its rows are uniform (every request the same number of rows, at most a page), its batch fits the
largest captured size, its keys fit the largest capacity and its logits are wanted at every row or at one row a
request; anything else (prefill chunks, mixed steps, MLA models, tensor parallelism) runs eagerly.

Mode "padded" runs the same buffers and padding eagerly (on a CPU, where nothing can be captured): tests show
through it that padded batches give the unpadded tokens and that the buffers keep their addresses, and compile
each callable the GPU captures with torch.compile(fullgraph=True), which fails on any host read.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from infer.attention.flashinfer_graphs import FlashInferGraphAttention, padded_plan
from infer.attention.static_backend import StaticPagedAttention
from infer.device_copy import pinned
from infer.kv_cache import PageMetadata, pages_needed
from infer.models.common import ModelOutput

# Padded batch sizes: every size to 4 (batch 1-4 is where a step is most host-bound and padding costs most
# relatively), then steps of 8 to 64 (at most 7 padded requests, under 12% extra rows from 8 on), then of 32: the
# same shape as SGLang's 1, 2, 4, 8, 16, 24, ... and vLLM's 1, 2, 4, 8, 16, ..., at a few graphs per shape since
# each costs its capture time and a little memory.
CAPTURE_SIZES = (1, 2, 3, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128)
MIN_KEY_PAGES = 4  # key capacities are powers of two pages from this: a graph per doubling of the context
GRAPH_MODES = ("off", "on", "padded")


def capture_sizes(max_seqs: int) -> list[int]:
    """The padded batch sizes for a runner serving up to max_seqs requests a forward."""
    sizes = [s for s in CAPTURE_SIZES if s < max_seqs]
    return sizes + [next((s for s in CAPTURE_SIZES if s >= max_seqs), max_seqs)]


def check_graph_mode(mode: str, device: torch.device) -> None:
    """One-line errors for cuda_graphs (EngineConfig) / --cuda-graphs."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graphs must be one of {', '.join(GRAPH_MODES)}, got {mode!r}")
    if mode == "on" and device.type != "cuda":
        raise ValueError(f"--cuda-graphs needs a CUDA device; the model is on {device} (use --no-cuda-graphs)")


@dataclass(frozen=True)
class GraphSettings:
    """What a runner's graphs serve: the mode (GRAPH_MODES), requests a forward, rows a request, the context."""

    mode: str = "off"
    max_seqs: int = 64
    max_q_len: int = 1
    max_model_len: int | None = None


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded requests
    q_len: int  # rows a request
    key_pages: int  # block-table columns
    logits_per_request: bool  # logits at one row a request (else at every row)
    aux_layers: tuple[int, ...]
    with_hidden: bool  # a head's forward: hidden states come in


class GraphRunner:
    """A model's captured forwards over static buffers (mode "on": CUDA graphs; "padded": the same path eagerly)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], page_size: int, dummy_page: int,
                 max_seqs: int, max_q_len: int, max_model_len: int, mode: str, backend: str = "torch") -> None:
        """backend: the runner's attention backend ("flashinfer": its graph wrappers; else torch SDPA over a static
        block table)."""
        self.model, self.kv_caches, self.page_size, self.dummy_page = model, kv_caches, page_size, dummy_page
        self.mode, self.sizes = mode, capture_sizes(max_seqs)
        self.max_q_len = min(max_q_len, page_size)  # a padded request's rows fit its one dummy page
        self.max_pages = max(MIN_KEY_PAGES, 1 << (pages_needed(max_model_len, page_size) - 1).bit_length())
        param = next(model.parameters())
        self.device = param.device
        tokens, batch = self.sizes[-1] * self.max_q_len, self.sizes[-1]
        new = lambda *shape: torch.zeros(shape, dtype=torch.long, device=self.device)  # noqa: E731
        self.input_ids, self.positions, self.k_rows, self.v_rows = new(tokens), new(tokens), new(tokens), new(tokens)
        self.block_table, self.logits_rows = new(batch, self.max_pages), new(batch)
        self.hidden: torch.Tensor | None = None  # [tokens, H] for a head, made on its first forward
        self.flashinfer = backend == "flashinfer"
        if self.flashinfer:
            self.attn = FlashInferGraphAttention(dtype=param.dtype, device=self.device, page_size=page_size,
                                                 max_batch=batch, max_pages=self.max_pages, **model.attention_dims())
        else:
            self.attn = StaticPagedAttention(page_size)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, ModelOutput]] = {}
        self.pool = None  # the graphs' shared memory pool
        self.num_runs = 0  # forwards served here (tests, bench)
        self.last_key: GraphKey | None = None  # the last forward's (tests)
        # padded requests: rows at positions 0..q_len-1 of the dummy page
        pad_positions = torch.arange(self.max_q_len, device=self.device)
        self._pad = (pad_positions, 2 * dummy_page * page_size + pad_positions)

    @property
    def attention(self) -> str:
        """What attends inside the graphs (the GPU check's rows say it)."""
        return "FlashInfer graph wrappers" if self.flashinfer else "static-paged SDPA"

    def key(self, meta: PageMetadata, logits_indices: torch.Tensor | None,
            model_inputs: dict) -> GraphKey | None:
        """The graph that serves this forward, or None where it runs eagerly."""
        batch, q_len = meta.batch_size, meta.max_q_len
        if (q_len > self.max_q_len or batch * q_len != meta.num_tokens or batch > self.sizes[-1]
                or (logits_indices is not None and logits_indices.shape != (batch,))):
            return None
        need = pages_needed(meta.max_kv_len, self.page_size)
        if need > self.max_pages:
            return None
        # FlashInfer's graphs read any context up to the buffers' (one graph a shape); SDPA's, up to their capacity
        key_pages = self.max_pages if self.flashinfer else max(MIN_KEY_PAGES, 1 << (need - 1).bit_length())
        padded = self.sizes[bisect.bisect_left(self.sizes, batch)]
        return GraphKey(padded, q_len, min(key_pages, self.max_pages), logits_indices is not None,
                        tuple(model_inputs.get("aux_layers", ())), model_inputs.get("hidden_states") is not None)

    def run(self, key: GraphKey, input_ids: torch.Tensor, meta: PageMetadata, logits_indices: torch.Tensor | None,
            model_inputs: dict) -> ModelOutput:
        """Copy the forward's inputs into the buffers, then replay its graph (capturing it first) or, padded, call
        the same callable; the outputs are the real rows'."""
        self._copy_in(key, input_ids, meta, logits_indices, model_inputs.get("hidden_states"))
        if self.flashinfer:  # host work before the replay, never inside a capture
            self.attn.plan(padded_plan(meta.on_host(), key.batch, key.q_len, self.dummy_page))
        self.num_runs, self.last_key = self.num_runs + 1, key
        if self.mode == "padded":
            out = self.callable(key)()
        else:
            out = self._replay(key)
        rows, wanted = meta.num_tokens, meta.batch_size if key.logits_per_request else meta.num_tokens
        return ModelOutput(out.logits[:wanted], out.hidden_states[:rows],
                           {layer: h[:rows] for layer, h in out.aux_hidden_states.items()})

    def callable(self, key: GraphKey) -> Callable[[], ModelOutput]:
        """What a graph captures for `key`: attention metadata from the block table, then the model, all on static
        views (no host read: it runs under torch.compile(fullgraph=True))."""
        tokens = key.batch * key.q_len
        attn = self.attn
        views = (self.input_ids[:tokens], self.positions[:tokens], self.logits_rows[: key.batch]
                 if key.logits_per_request else None)
        extra = {"aux_layers": key.aux_layers} if key.aux_layers else {}
        if key.with_hidden:
            extra["hidden_states"] = self.hidden[:tokens]
        if self.flashinfer:
            bound = (key.batch, key.q_len, self.k_rows[:tokens], self.v_rows[:tokens])
        else:
            bound = (self.block_table[: key.batch, : key.key_pages], self.positions[:tokens], self.k_rows[:tokens],
                     self.v_rows[:tokens], key.q_len)

        def forward() -> ModelOutput:
            attn.bind(*bound)
            attn.prepare()
            return self.model(views[0], views[1], attn, self.kv_caches, views[2], **extra)

        return forward

    def _copy_in(self, key: GraphKey, input_ids: torch.Tensor, meta: PageMetadata,
                 logits_indices: torch.Tensor | None, hidden: torch.Tensor | None) -> None:
        """The step's rows into [:rows] of each buffer, the padded requests' rows after them (dummy page)."""
        rows, tokens, batch = meta.num_tokens, key.batch * key.q_len, meta.batch_size
        self.input_ids[:rows].copy_(input_ids)
        self.positions[:rows].copy_(meta.positions)
        self.k_rows[:rows].copy_(meta.cache_rows[:rows])
        self.v_rows[:rows].copy_(meta.cache_rows[rows:])
        if tokens > rows:
            pad_positions, pad_rows = (t[: key.q_len].repeat(key.batch - batch) for t in self._pad)
            self.positions[rows:tokens].copy_(pad_positions)
            self.k_rows[rows:tokens].copy_(pad_rows)
            self.v_rows[rows:tokens].copy_(pad_rows + self.page_size)
        if not self.flashinfer:
            self.block_table[: key.batch, : key.key_pages].copy_(self._block_table(meta, key), non_blocking=True)
        if logits_indices is not None:
            self.logits_rows[:batch].copy_(logits_indices)
            self.logits_rows[batch : key.batch].zero_()  # padded requests read row 0, never a stale row past T
        if hidden is not None:
            if self.hidden is None:
                self.hidden = torch.zeros(self.input_ids.shape[0], hidden.shape[1], dtype=hidden.dtype,
                                          device=self.device)
            self.hidden[:rows].copy_(hidden)

    def _block_table(self, meta: PageMetadata, key: GraphKey) -> torch.Tensor:
        """[padded batch, key pages] page ids on the host, from the metadata's host copy: the dummy page past each
        sequence's pages and in the padded requests' rows."""
        host = meta.on_host()
        counts = (host.kv_indptr[1:] - host.kv_indptr[:-1]).long()
        table = torch.full((key.batch, key.key_pages), self.dummy_page, dtype=torch.long)
        rows = torch.repeat_interleave(torch.arange(meta.batch_size), counts)
        cols = torch.arange(counts.sum().item()) - torch.repeat_interleave(host.kv_indptr[:-1].long(), counts)
        table[rows, cols] = host.kv_indices[: host.kv_indptr[-1]].long().cpu()
        return pinned(table, self.device)

    def _replay(self, key: GraphKey) -> ModelOutput:
        """Replay key's graph (captured on first use, after two warm-up runs on a side stream, as the buffers hold a
        real step whose K/V writes the warm-ups repeat); outputs are cloned out of the graph's pool, which the next
        replay of this or another graph overwrites."""
        held = self.graphs.get(key)
        if held is None:
            forward = self.callable(key)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    forward()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = forward()
            self.pool = graph.pool()
            held = self.graphs[key] = (graph, out)
        graph, out = held
        graph.replay()
        return ModelOutput(out.logits.clone(), out.hidden_states.clone(),
                           {layer: h.clone() for layer, h in out.aux_hidden_states.items()})
