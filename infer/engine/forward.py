"""A step's one packed target forward: the rows that do not speculate (prefill chunks, plain decodes), then K+1
verify rows per speculating request; and what the drafter reads of it afterwards (`TargetForward.target_rows`).

A batch of one-token rows that stays the same takes its steps from a decode run the runner plans at once
(`decode_run_step`, `infer.model_runner.DecodeRuns`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from infer.device_copy import device_tensor
from infer.engine.request import Request
from infer.kv_cache import PageMetadata, PagePool, build_page_metadata
from infer.model_runner import DecodeRuns, ModelRunner
from infer.speculative import TargetRows


@dataclass
class PlainRows:
    """A step's rows that do not speculate (prefill chunks, plain decodes), packed; advances their num_computed."""

    scheduled: list[tuple[Request, int]]
    input_ids: list[int] = field(default_factory=list)
    q_lens: list[int] = field(default_factory=list)
    kv_lens: list[int] = field(default_factory=list)
    page_lists: list[list[int]] = field(default_factory=list)
    sampling: list[tuple[Request, int]] = field(default_factory=list)  # (request, its last row), when it samples
    num_decodes: int = 0  # decode steps among them (requests that have generated before)

    def __post_init__(self) -> None:
        for request, q_len in self.scheduled:
            self.num_decodes += q_len == 1 and request.num_tokens - request.num_computed == 1 and bool(request.output_ids)
            self.input_ids.extend(request.token_ids[request.num_computed : request.num_computed + q_len])
            self.q_lens.append(q_len)
            self.kv_lens.append(request.num_computed + q_len)
            self.page_lists.append(request.page_table.pages)
            request.num_computed += q_len
            if request.num_computed == request.num_tokens:
                self.sampling.append((request, len(self.input_ids) - 1))
        self.first_rows = [0, *itertools.accumulate(self.q_lens)]

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def sample_rows(self) -> list[int]:
        return [row for _, row in self.sampling]


def decode_run_step(runs: DecodeRuns, rows: PlainRows, pool: PagePool, max_model_len: int) -> PageMetadata | None:
    """The batch's step of a decode run: the current run's next while the batch stays the same requests in the same
    order, else a new run's first where a batch of one-token rows fits one (`DecodeRuns.fits`) and the pool holds
    the pages its steps write (reserved here); None (a step built alone) otherwise. Not with a drafter attached:
    every step then writes the page tables' tails its own way."""
    if rows.num_tokens != len(rows.scheduled):
        return runs.next_step([r.request_id for r, _ in rows.scheduled], rows.kv_lens)
    return decode_batch_step(runs, [r for r, _ in rows.scheduled], rows.kv_lens, rows.page_lists, pool,
                             max_model_len)


def decode_batch_step(runs: DecodeRuns, requests: list[Request], kv_lens: list[int], page_lists: list[list[int]],
                      pool: PagePool, max_model_len: int, unread: int = 0) -> PageMetadata | None:
    """`decode_run_step` for a batch of one-token rows given by its requests and kv lengths (an overlapped step's
    rows are not on the host as PlainRows: `infer.engine.overlap`); unread: tokens each request has sampled that
    the host has not appended yet (they count against max_new_tokens)."""
    request_ids = [r.request_id for r in requests]
    meta = runs.next_step(request_ids, kv_lens)
    if meta is not None or not runs.fits(kv_lens):
        return meta
    # the run ends where the first request would stop for length (an earlier stop ends it too) or meet the
    # context's end
    steps = min(runs.next_steps, *(r.params.max_new_tokens - len(r.output_ids) - unread for r in requests),
                *(max_model_len - kv + 1 for kv in kv_lens))
    ends = [kv + steps - 1 for kv in kv_lens]
    if steps <= 1 or sum(r.page_table.pages_to_grow(end) for r, end in zip(requests, ends)) > pool.num_free:
        return None
    for request, end in zip(requests, ends):
        request.page_table.extend(end)
    return runs.start(request_ids, page_lists, kv_lens, steps)


class TargetForward:
    """A step's one target forward: the plain rows, then K+1 verify rows per speculating request; called with the
    verify ids by `speculative_decode` (or with None), it keeps what the drafter reads of it (`target_rows`)."""

    def __init__(self, runner: ModelRunner, page_size: int, rows: PlainRows, speculating: list[Request], k: int,
                 aux_layers: tuple[int, ...], meta: PageMetadata | None) -> None:
        """aux_layers: the target layers the drafter reads; meta: the plain rows' decode-run step, where they take
        one (`decode_run_step`), else built here."""
        self.runner, self.page_size, self.rows, self.speculating = runner, page_size, rows, speculating
        self.k, self.aux_layers, self.meta = k, aux_layers, meta

    def __call__(self, verify_ids: torch.Tensor | None) -> torch.Tensor | None:
        """[B_spec, K+1] verify ids, or None without speculation -> the verify rows' logits [B_spec * (K+1), V].

        The forward's logits come for the plain rows that sample, then for every verify row; its hidden states for
        all rows (`output`)."""
        rows, speculating, k, device = self.rows, self.speculating, self.k, self.runner.device
        if self.meta is None:
            self.meta = build_page_metadata(rows.page_lists + [r.page_table.pages for r in speculating],
                                            rows.q_lens + [k + 1] * len(speculating),
                                            rows.kv_lens + [r.num_computed + k + 1 for r in speculating],
                                            self.page_size, device)
        logits_rows = None  # decodes only, or verify rows only: every row's logits
        if not rows.num_tokens:
            ids = verify_ids.flatten()
        else:
            ids = device_tensor(rows.input_ids, device, torch.long)
            if speculating or len(rows.sampling) < rows.num_tokens:
                logits_rows = device_tensor(rows.sample_rows, device, torch.long)
            if speculating:
                ids = torch.cat((ids, verify_ids.flatten()))
                logits_rows = torch.cat((logits_rows, torch.arange(rows.num_tokens, ids.shape[0], device=device)))
        self.input_ids = ids
        self.output = self.runner.run(ids, self.meta, logits_rows, aux_layers=self.aux_layers)
        return self.output.logits[len(rows.sample_rows):] if speculating else None

    def target_rows(self, sampled: torch.Tensor | None, emitted: torch.Tensor | None,
                    num_emitted: torch.Tensor | None) -> TargetRows:
        """The forward's rows for the drafter, from the plain rows' sampled tokens [S] and the verify's emitted
        tokens [B_spec, K+1] and counts [B_spec], all on the device: each verify's last settled row comes from its
        count there."""
        rows, device = self.rows, self.runner.device
        last_rows, next_ids = [], []
        if rows.scheduled:
            last_rows.append(device_tensor([first - 1 for first in rows.first_rows[1:]], device))
            next_ids.append(self._plain_next_ids(sampled))
        if self.speculating:
            width, first = self.k + 1, rows.num_tokens
            last_rows.append(torch.arange(first - 1, first - 1 + width * len(self.speculating), width,
                                          device=device) + num_emitted)
            next_ids.append(emitted.clamp_min(0).flatten())  # row j reads emitted token j; past them, any
        return TargetRows([r for r, _ in rows.scheduled] + self.speculating, self.input_ids, _cat(next_ids),
                          _cat(last_rows), self.meta, self.output, len(self.speculating))

    def _plain_next_ids(self, sampled: torch.Tensor | None) -> torch.Tensor:
        """[T_plain] the token after each plain row: the next row's, the next prompt token after a chunk, or the
        token sampled at the row."""
        rows = self.rows
        if sampled is not None and len(rows.sampling) == rows.num_tokens:  # every row samples
            return sampled
        following = rows.input_ids[1:] + [0]
        for (request, _), end in zip(rows.scheduled, rows.first_rows[1:]):
            if request.num_computed < request.num_tokens:  # a prompt chunk: its next token is known
                following[end - 1] = request.token_ids[request.num_computed]
        next_ids = device_tensor(following, self.runner.device, torch.long)
        if sampled is not None:
            next_ids[device_tensor(rows.sample_rows, self.runner.device)] = sampled
        return next_ids


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
