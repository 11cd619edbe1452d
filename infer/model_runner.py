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

import torch

from infer.attention import FlashInferAttention, TorchAttention, resolve_backend_name
from infer.kv_cache import PageMetadata
from infer.models.common import ModelOutput
from infer.parallel import broadcast_step, group_of, register_runner


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str = "auto") -> None:
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.kv_caches = model.allocate_kv_cache(num_pages, page_size, self.dtype, self.device)  # KV in the model's dtype
        self.backend_name = resolve_backend_name(backend, self.device)
        if self.backend_name == "flashinfer":
            self.attn = FlashInferAttention(dtype=self.dtype, device=self.device, **model.attention_dims())
        else:
            self.attn = TorchAttention()
        self.tp = group_of(model)
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
        five or so forwards: each entry costs about 5 us, a tenth of a speculative step's host work at batch 1)."""
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.run(input_ids, meta, logits_indices, **model_inputs)
        start = time.perf_counter()
        if self.runner_id is not None:
            broadcast_step(self.tp, self.runner_id, input_ids, meta, logits_indices, model_inputs)
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
