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


class HostCopy:
    """A device tensor's values on the host, copied now and read later: on a GPU a non-blocking copy into pinned
    memory with an event recorded after it, so the read waits for that copy (and the work queued before it) alone,
    not for what was launched after it (the next step's forward); on a CPU the tensor itself."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.event: torch.cuda.Event | None = None
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tensor

    def tolist(self) -> list:
        """The values, once the copy has landed (the host waits here, and only here)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
