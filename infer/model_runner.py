"""One model, its KV-cache tensors and its attention backend: runs a packed step against shared page tables.

The engine owns the page pool and the page tables; a target and a drafter each get a runner whose KV
tensors are indexed by the same page ids, so one allocator serves both.

`run` is the only place a model is invoked, which makes it the seam for tensor parallelism: a runner over a
sharded model, on rank 0 (where the engine schedules), broadcasts each step before running it; the other
ranks run the same step through `forward` from `infer.parallel.serve_forever`.

A runner serves the model it is given as it is; a loader makes the models it loads lean first
(`infer.loader.serve_lean`: without nn.Module's per-call machinery).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from infer.attention import AttentionBackend, FlashInferAttention, TorchAttention, resolve_backend_name
from infer.cuda_graphs import GraphRunner, check_graph_mode
from infer.kv_cache import DecodeSteps, PageMetadata
from infer.models.common import ModelOutput
from infer.parallel import broadcast_step, group_of, register_runner

DECODE_RUN_MAX_SEQS = 32  # decode runs serve batches up to this: past it the batch changes every few steps and a
                          # step's plan is a small share of it (see docs/benchmark_history.md)


@dataclass
class _DecodeRun:
    """A run's steps, the batch's requests in order, their kv lengths at its first step, and the next step."""

    steps: DecodeSteps
    request_ids: list[int]
    first_kv_lens: list[int]
    next: int = 1


class DecodeRuns:
    """Plain decode steps planned at once: while a batch stays the same requests in the same order, each step is
    the next of a run built at once (`DecodeSteps`: one metadata build and one attention plan per run instead of
    one per step; each step reads the run's last step's pages, masked). A run lasts up to twice as many steps as the
    last one served (up to max_steps), so runs stay about as short as the batch stays the same."""

    def __init__(self, attn: AttentionBackend, max_steps: int, page_size: int, device: torch.device) -> None:
        self.attn, self.max_steps, self.page_size, self.device = attn, max_steps, page_size, device
        self.next_steps = max_steps  # the most steps the next run may take
        self._run: _DecodeRun | None = None

    def next_step(self, request_ids: list[int], kv_lens: list[int]) -> PageMetadata | None:
        """The batch's step of the current run where it continues it (the same requests in the same order, each
        one token further, steps left); otherwise the run ends and None."""
        run = self._run
        if run is None:
            return None
        if (run.next < run.steps.num_steps and request_ids == run.request_ids
                and kv_lens == [kv + run.next for kv in run.first_kv_lens]):
            run.next += 1
            return run.steps.step(run.next - 1)
        self._run, self.next_steps = None, min(2 * run.next, self.max_steps)
        return None

    def reset(self) -> None:
        """End the current run: its requests' pages changed under it (requeued, aborted), so the next step plans
        anew even where the same requests come back at the lengths the run expects."""
        self._run = None

    def fits(self, kv_lens: list[int]) -> bool:
        """Whether a new run may serve a batch of one-token rows with these kv lengths: runs of more than one step,
        up to DECODE_RUN_MAX_SEQS sequences, where the backend attends a run as it would attend each step
        (`AttentionBackend.serves_decode_run`)."""
        return self.max_steps > 1 and len(kv_lens) <= DECODE_RUN_MAX_SEQS and self.attn.serves_decode_run(kv_lens)

    def start(self, request_ids: list[int], page_lists: list[list[int]], kv_lens: list[int],
              steps: int) -> PageMetadata:
        """A new run of `steps` steps over the batch, whose page tables already hold the pages its steps write;
        returns its first step."""
        first_positions = [kv - 1 for kv in kv_lens]
        self._run = _DecodeRun(DecodeSteps(page_lists, first_positions, steps, self.page_size, self.device),
                               list(request_ids), list(kv_lens))
        return self._run.steps.step(0)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str = "auto",
                 decode_run_steps: int = 16, cuda_graphs: str = "off", max_seqs: int = 64,
                 max_q_len: int = 1, max_model_len: int | None = None) -> None:
        """decode_run_steps: the longest run of plain decode steps planned at once (`decode_runs`; 1: none);
        cuda_graphs: "on" replays uniform forwards of up to max_seqs requests of up to max_q_len rows from CUDA
        graphs, "padded" runs the same padded static-buffer path eagerly (CPU tests), "off" (`infer.cuda_graphs`)."""
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        check_graph_mode(cuda_graphs, self.device)
        self.tp = group_of(model)
        graphs = cuda_graphs != "off" and self.tp.size == 1 and model.attention_dims()["mla_dims"] is None
        # with graphs, one page more than the pool hands out: the padded requests' dummy page
        self.kv_caches = model.allocate_kv_cache(num_pages + graphs, page_size, self.dtype, self.device)
        self.backend_name = resolve_backend_name(backend, self.device)
        self.graphs = GraphRunner(model, self.kv_caches, page_size, num_pages, max_seqs, max_q_len,
                                  max_model_len or model.config.max_position_embeddings,
                                  cuda_graphs, self.backend_name) if graphs else None
        if self.backend_name == "flashinfer":
            self.attn = FlashInferAttention(dtype=self.dtype, device=self.device, **model.attention_dims())
        else:
            self.attn = TorchAttention()
        self.decode_runs = DecodeRuns(self.attn, decode_run_steps, page_size, self.device)
        self.runner_id = register_runner(self) if self.tp.size > 1 else None  # the same on every rank
        # seconds this rank has spent in `run` (a forward and its broadcast): on a CPU the forwards' time, on a GPU
        # only their launches (the kernels run on), so a step's host work is its time less this on a CPU alone
        self.forward_s = 0.0

    def run(
        self,
        input_ids: torch.Tensor,
        meta: PageMetadata,
        logits_indices: torch.Tensor | None = None,
        **model_inputs,
    ) -> ModelOutput:
        """model_inputs: aux_layers=(...) for a language model, hidden_states=[T, H] for an MTP head.

        In inference mode, entered here unless the caller is in it already (`Engine.step` enters it once for its
        five or so forwards: each entry costs host time, see docs/benchmark_history.md)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.run(input_ids, meta, logits_indices, **model_inputs)
        start = time.perf_counter()
        if self.runner_id is not None:
            broadcast_step(self.tp, self.runner_id, input_ids, meta, logits_indices, model_inputs)
        key = self.graphs.key(meta, logits_indices, model_inputs) if self.graphs is not None else None
        if key is not None:
            out = self.graphs.run(key, input_ids, meta, logits_indices, model_inputs)
            self.attn.forget()  # the eager backend's kept state (TorchAttention's mirror) missed these writes
        else:
            out = self.forward(input_ids, meta, logits_indices, **model_inputs)
        self.forward_s += time.perf_counter() - start
        return out

    def forward(
        self,
        input_ids: torch.Tensor,
        meta: PageMetadata,
        logits_indices: torch.Tensor | None = None,
        **model_inputs,
    ) -> ModelOutput:
        """This rank's part of a step: on rank 0 through `run`, on the others as `serve_forever` receives it (both
        in inference mode already: entering it again costs a microsecond per forward)."""
        self.attn.plan(meta)
        return self.model(input_ids, meta.positions, self.attn, self.kv_caches, logits_indices, **model_inputs)
