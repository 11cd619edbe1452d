"""One model, its KV-cache tensors and its attention backend: runs a packed step against shared page tables.

The engine owns the page pool and the page tables; a target and a drafter each get a runner whose KV
tensors are indexed by the same page ids, so one allocator serves both.

`run` is the only place a model is invoked, which makes it the seam for tensor parallelism: a runner over a
sharded model, on rank 0 (where the engine schedules), broadcasts each step before running it; the other
ranks run the same step through `forward` from `infer.parallel.serve_forever`.

A runner serves its model without nn.Module's per-call machinery (`drop_module_overhead`): on small models that
machinery is a sixth of a decode step.
"""

from __future__ import annotations

import time

import torch

from infer.attention import FlashInferAttention, TorchAttention, resolve_backend_name
from infer.kv_cache import PageMetadata
from infer.models.common import ModelOutput
from infer.parallel import broadcast_step, group_of, register_runner


_GLOBAL_HOOKS = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                 "_global_backward_pre_hooks")
_MODULE_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_LEAN_CLASSES: dict[type, type] = {}


def _call_forward(module: torch.nn.Module, *args, **kwargs):
    return module.forward(*args, **kwargs)  # the instance's forward: one patched on a module still runs


def drop_module_overhead(model: torch.nn.Module) -> None:
    """Take nn.Module's per-call machinery out of a served model's forward, for every submodule without hooks.

    On a small model it is a sixth of a decode step (stories260K, one thread, plain decode: 1.21x tokens/s at batch
    1, 1.15x at 8): `module(x)` dispatches hooks around each forward, and each `self.weight` or `self.mlp` is a
    Python call into `__getattr__`. Each module gets a subclass of its own class whose __call__ calls its forward
    (isinstance, names and state_dict are unchanged), and its parameters and submodules become instance attributes
    too. nn.Module's __setattr__ drops such a copy when a parameter or submodule is replaced, so assign them as usual
    (never through `_parameters` directly); a model moved to another device or dtype is served anew. A module with
    hooks (DeepSpeed ZeRO-3 places them on a model it trains) keeps the full dispatch, and so does every module
    while a global hook is registered; a hook registered on a module after this does not run.
    """
    if any(getattr(torch.nn.modules.module, name) for name in _GLOBAL_HOOKS):
        return
    for module in model.modules():
        cls = type(module)
        if cls not in _LEAN_CLASSES.values():
            if cls.__call__ is not torch.nn.Module.__call__ or any(getattr(module, name) for name in _MODULE_HOOKS):
                continue
            if cls not in _LEAN_CLASSES:
                _LEAN_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": _call_forward, "__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
            module.__class__ = _LEAN_CLASSES[cls]
        module.__dict__.update(module._parameters)
        module.__dict__.update(module._modules)


class ModelRunner:
    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str = "auto") -> None:
        drop_module_overhead(model)
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
