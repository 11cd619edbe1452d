"""One model, its KV-cache tensors and its attention backend: runs a packed step against shared page tables.

The engine owns the page pool and the page tables; a target and a drafter each get a runner whose KV
tensors are indexed by the same page ids, so one allocator serves both.
"""

from __future__ import annotations

import torch

from infer.attention import FlashInferAttention, TorchAttention, resolve_backend_name
from infer.kv_cache import PageMetadata
from infer.models.common import ModelOutput


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

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,
        meta: PageMetadata,
        logits_indices: torch.Tensor | None = None,
        **model_inputs,
    ) -> ModelOutput:
        """model_inputs: aux_layers=(...) for a language model, hidden_states=[T, H] for an MTP head."""
        self.attn.plan(meta)
        return self.model(input_ids, meta.positions, self.attn, self.kv_caches, logits_indices, **model_inputs)
