"""The forwards behind a block head's speculative step (infer.block_drafter), timed as infer.bench.forward_costs
times the other drafters': a plain decode run, then cycles of the catch-up (the context keys/values of the K+1 verify
rows), one block forward (B rows a sequence over its cached context) and the verify forward, in turns."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.bench.forward_costs import ForwardCosts, Stopwatch
from infer.kv_cache import PageTable
from infer.models.common import ModelOutput
from infer.speculative import TargetRows


@dataclass
class _Pending:
    """What the block drafter reads of a request (SpeculatingRequest): its pages, settled length, pending token."""

    request_id: int
    token_ids: list[int]
    num_computed: int
    page_table: PageTable


class BlockTimedForwards:
    """`_TimedForwards`' interface (round, repeated, draft, catch_up, verify) for a block drafter, on its pages."""

    def __init__(self, timed, tables: list[PageTable], context: int) -> None:
        self.timed, self.engine, self.watch = timed, timed.engine, timed.watch
        drafter, device = self.engine.drafter, self.engine.device
        self.requests = [_Pending(i, [1], context, t) for i, t in enumerate(tables)]
        rows = timed.verify_meta.num_tokens
        hidden = torch.zeros(rows, self.engine.model.config.hidden_size, device=device, dtype=drafter.runner.dtype)
        output = ModelOutput(None, hidden, {layer: hidden for layer in drafter.target_aux_layers})
        ids = torch.ones(rows, dtype=torch.long, device=device)
        self.rows = TargetRows([], ids, ids, torch.arange(len(tables), device=device), timed.verify_meta, output)
        self.fastest_burst = timed.fastest_burst
        self.repeated = timed.repeated
        self.verify = timed.verify

    def draft(self) -> None:
        self.engine.drafter.block_logits(self.requests, self.engine.drafter.block_rows(self.timed.k), self.timed.k)

    def catch_up(self) -> None:
        self.engine.drafter.propose(self.rows)

    def round(self, steps: int) -> ForwardCosts:
        decode = self.timed.decode_run(steps)
        catch_ups, drafts, verifies = (Stopwatch(self.engine.device) for _ in range(3))
        for _ in range(steps):
            catch_ups.measure(self.catch_up)
            drafts.measure(self.draft)
            verifies.measure(self.verify)
        return ForwardCosts(decode, drafts.total() / steps, verifies.total() / steps, catch_ups.total() / steps,
                            one_forward=True)
