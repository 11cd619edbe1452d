"""Host data onto the device without waiting for it: a step's small inputs (token ids, page metadata, sampling
parameters) go through pinned memory and an asynchronous copy.

A plain `.to("cuda")` or `torch.tensor(values, device="cuda")` from pageable memory copies with `memcpy_and_sync`
(ATen's Copy.cu): the host waits until every kernel queued before it has run, so the host cannot build the next
forward while the GPU runs this one, and `torch.cuda.set_sync_debug_mode` counts it as a sync. `pin_memory()` takes a
block of the caching host allocator, which keeps it until the copy's recorded event has passed. On a CPU, nothing
changes.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def is_cuda(device: torch.device | str) -> bool:
    return (device.type if isinstance(device, torch.device) else torch.device(device).type) == "cuda"


def pinned(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """host in pinned memory where it is bound for a GPU (an asynchronous copy's source), else itself."""
    return host.pin_memory() if is_cuda(device) else host


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, copied asynchronously where that is a GPU (the tensor itself on a CPU)."""
    if not is_cuda(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def device_tensor(values: Sequence, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device) without a stream sync on a GPU."""
    if not is_cuda(device):
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)
