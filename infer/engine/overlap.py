"""Overlapped plain decoding (`EngineConfig.overlap`): step N+1 is launched on the device before the host reads
step N's sampled tokens, so the host's read, stop checks and the next step's metadata run while the device works.

The next step's input ids are step N's sampled tokens as they lie on the device; a request that step N finishes
(a stop id, a stop string) has its row of step N+1 computed and its token discarded on the read, as SGLang's
overlap scheduler does (`python/sglang/srt/managers/scheduler.py`, `event_loop_overlap`: the next batch run before
the last batch's results are processed; its next input ids come from a device-side future map). Lossless: every
request draws from its own generator (`infer.sampler.make_generator`), so a discarded row moves no one else's
noise, and a step's batch is the non-overlapped engine's but for an admission a step later where every seat was
taken (`follow_on`), which no request's tokens depend on where the forward is batch-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.device_copy import HostCopy, device_tensor
from infer.engine.forward import decode_batch_step
from infer.engine.request import Request
from infer.kv_cache import build_page_metadata
from infer.sampler import SamplingTensors, sample

if TYPE_CHECKING:
    from infer.engine.loop import Engine


@dataclass
class LaunchedStep:
    """A plain step launched on the device whose sampled tokens the host has not read yet: the requests that
    sample, in row order, their tokens [S] on the device, and their sampling tensors (reused while the batch
    stays the same)."""

    requests: list[Request]
    sampled: torch.Tensor | None
    sampling: SamplingTensors | None
    _host: HostCopy | None = None

    def copy_to_host(self) -> None:
        """Start the tokens' copy to the host (`HostCopy`): before the next step is launched, so that the read
        waits for this step's work alone."""
        if self._host is None and self.sampled is not None:
            self._host = HostCopy(self.sampled)

    def tokens(self) -> list[int]:
        """The step's one host read: its sampled tokens, in row order."""
        self.copy_to_host()
        return self._host.tolist() if self._host is not None else []

    @property
    def live(self) -> bool:
        """Whether any of its requests still runs (else its tokens are all discarded)."""
        return any(not r.finished for r in self.requests)


def follow_on(engine: Engine, prev: LaunchedStep) -> LaunchedStep | None:
    """Launch the plain decode step after `prev` from its device-side tokens, before the host reads them; None where
    it cannot: a drafter is attached, a request waits that the next step could admit (it is then scheduled on the
    host as usual, after the read), some running request did not sample at `prev` (a prompt chunk), or the pool
    lacks a page. Requests that `prev` ends by length sit it out; those it ends otherwise are only known on the
    read, which discards their row."""
    if engine.drafter is not None or prev.sampled is None:
        return None
    alive = [i for i, r in enumerate(prev.requests) if not r.finished]
    running = engine.running
    if len(alive) != len(running) or any(prev.requests[i] is not r for i, r in zip(alive, running)):
        return None
    keep = [i for i in alive if _continues(prev.requests[i], engine.max_model_len)]
    requests = [prev.requests[i] for i in keep]
    if not requests or (engine.waiting and _may_admit(engine, len(requests))):
        return None
    kv_lens = [r.num_computed + 1 for r in requests]  # the unread token's position is num_computed
    if sum(r.page_table.pages_to_grow(kv) for r, kv in zip(requests, kv_lens)) > engine.pool.num_free:
        return None
    for request, kv in zip(requests, kv_lens):
        request.page_table.extend(kv)
    page_lists = [r.page_table.pages for r in requests]
    runner = engine.runner
    meta = decode_batch_step(runner.decode_runs, requests, kv_lens, page_lists, engine.pool, engine.max_model_len,
                             unread=1)
    if meta is None:
        meta = build_page_metadata(page_lists, [1] * len(requests), kv_lens, engine.config.page_size, runner.device)
    same = len(keep) == len(prev.requests)
    ids = prev.sampled if same else prev.sampled[device_tensor(keep, runner.device, torch.long)]
    for request in requests:
        request.num_computed += 1
    engine.num_steps += 1
    output = runner.run(ids, meta, None, aux_layers=())
    tensors = prev.sampling if same and prev.sampling is not None else SamplingTensors.from_params(
        [r.params for r in requests], runner.device)
    return LaunchedStep(requests, sample(output.logits, tensors, [r.generator for r in requests]), tensors)


def _may_admit(engine: Engine, num_decodes: int) -> bool:
    """Whether a step of `num_decodes` decodes leaves room (sequences, token budget) to admit a waiting request.
    Where it does not, the non-overlapped engine would schedule the same decodes; a request that the read stops
    frees a seat a step later than without overlap (the same tokens, a step's delay to admission)."""
    config = engine.config
    return num_decodes < config.max_num_seqs and num_decodes < config.max_num_batched_tokens


def _continues(request: Request, max_model_len: int) -> bool:
    """Whether a request may go on after its unread token: neither max_new_tokens nor the context ends it there."""
    return len(request.output_ids) + 1 < request.params.max_new_tokens and request.num_computed + 1 < max_model_len
