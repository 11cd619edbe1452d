"""What one forward costs at a batch size, timed as a speculative step runs them: the prices behind the ideal
speculative speedup (`infer.bench.speedup`)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from infer.engine import Engine
from infer.kv_cache import DecodeSteps, PageMetadata, PageTable, build_page_metadata


@dataclass
class ForwardCosts:
    """Seconds of one forward at a batch size, behind the ideal speculative speedup (see infer.bench.speedup).

    draft, verify and catch_up are timed as a speculative step runs them, cycle after cycle: the two models take
    turns on the core's caches, as they would in a runtime with no host work at all. draft_alone, verify_alone and
    catch_up_alone, where measured, are each forward repeated back to back: cheaper than in turns, a bound no
    speculative step meets (see docs/benchmark_history.md)."""

    decode: float  # the target over one new token per sequence
    draft: float  # the drafter over one new token per sequence
    verify: float  # the target over K+1 new tokens per sequence
    # A head's catch-up: over the K+1 verify rows per sequence, its output at one row each (`infer.speculative`):
    # the step's first drafter forward, whose output proposes the first draft. None for a draft LM, which catches up
    # over the one or two positions past its drafts: a draft forward's price.
    catch_up: float | None = None
    draft_alone: float | None = None
    verify_alone: float | None = None
    catch_up_alone: float | None = None
    one_forward: bool = False  # a block head (infer.block_drafter): one draft forward a step, whatever K

    def drafting(self, k: int) -> float:
        """Seconds of a step's drafter forwards: a head's catch-up and K-1 drafts, a draft LM's K drafts, or a block
        head's catch-up (its context projection) and one block forward."""
        if self.one_forward:
            return (self.catch_up or 0.0) + self.draft
        return k * self.draft if self.catch_up is None else self.catch_up + (k - 1) * self.draft

    def alone(self) -> "ForwardCosts":
        """The same forwards priced back to back, each model alone."""
        if self.draft_alone is None or self.verify_alone is None:
            raise ValueError("these forward costs were measured in turns only (forward_costs(..., alone=True) times both)")
        return ForwardCosts(self.decode, self.draft_alone, self.verify_alone, self.catch_up_alone,
                            one_forward=self.one_forward)

    def milliseconds(self) -> dict[str, float | None]:
        """Each forward's cost in ms (3 decimals) by field name, None where not measured: reports print these."""
        return {f.name: None if getattr(self, f.name) is None else round(getattr(self, f.name) * 1e3, 3)
                for f in fields(self) if f.name != "one_forward"}

    @classmethod
    def from_milliseconds(cls, values: dict[str, float | None], one_forward: bool = False) -> "ForwardCosts":
        """The costs a report printed (`milliseconds`; one_forward: a block head's, which it does not print)."""
        return cls(**{name: None if ms is None else ms / 1e3 for name, ms in values.items()
                      if name != "one_forward"}, one_forward=one_forward)

    @classmethod
    def fastest(cls, measured: "Sequence[ForwardCosts]") -> "ForwardCosts":
        """Each forward's fastest over measurements taken at different times (noise only ever adds time)."""
        def fastest_of(name: str) -> float | None:
            values = [getattr(c, name) for c in measured]
            return None if None in values else min(values)

        return cls(**{f.name: fastest_of(f.name) for f in fields(cls)})


def forward_costs(engine: Engine, batch_size: int, context: int = 32, repeats: int = 10,
                  num_draft_tokens: int | None = None, alone: bool = False) -> ForwardCosts:
    """Each forward behind speculation on `engine` over batch_size sequences with `context` tokens cached (pages
    borrowed from the pool, then returned); the verify forward is K+1 tokens long, K the engine's or
    `num_draft_tokens`.

    All are timed alike: each burst's mean. A round is a plain decode burst, a decode run of `decode_run_steps`
    forwards, its plan paid once, as the engine runs it, then a speculative burst, `decode_run_steps` cycles of
    the drafter's forwards and a verify forward (`ForwardCosts`: the models take turns; a head's cycle opens with
    its catch-up over the K+1 verify rows, as each step's drafting does); the costs come from the
    fastest of `repeats` rounds, so that the ratios behind the ideal speedup are measured within the same tens of
    milliseconds (the fastest burst of each kind would come from different spells of a shared machine). Decode is
    timed back to back, as plain decoding runs it, not in turns with the speculative cycles, which would price it
    high. With `alone`, the draft, verify and catch-up forwards are also timed in bursts of one forward repeated
    (the fastest of each). Every cost is a burst's mean: one forward's fastest time sits below the mean that
    successive forwards keep, so timing speculation's forwards singly would price them low against plain decoding's
    (see docs/benchmark_history.md).
    """
    if engine.drafter is None:
        raise RuntimeError("forward costs of speculation need a drafter attached")
    k = num_draft_tokens or engine.num_draft_tokens
    burst = engine.config.decode_run_steps
    tables = [PageTable(engine.pool) for _ in range(batch_size)]
    try:
        for table in tables:
            table.extend(context + max(k + 1, burst))
        timed = _TimedForwards(engine, [t.pages for t in tables], context, k)
        if engine.drafter.kind == "block":  # one draft forward a step (infer.bench.block_costs)
            from infer.bench.block_costs import BlockTimedForwards  # it builds on this module

            timed = BlockTimedForwards(timed, tables, context)
        costs = timed.fastest_burst(repeats, lambda: timed.round(burst),
                                    key=lambda c: c.decode + c.drafting(k) + c.verify)  # a decode and a cycle
        if not alone:
            return costs
        def alone_cost(forward) -> float:
            return timed.fastest_burst(repeats, lambda: timed.repeated(forward, burst))

        return replace(costs, draft_alone=alone_cost(timed.draft), verify_alone=alone_cost(timed.verify),
                       catch_up_alone=None if costs.catch_up is None else alone_cost(timed.catch_up))
    finally:
        for table in tables:
            table.free()


class Stopwatch:
    """Seconds of forwards. The host clock on a CPU; on a GPU, CUDA events around the launches, read once a burst is
    done: a forward returns at launch there, so the host clock would time launches, not kernels (and a
    synchronize per forward would add a wait that no speculative step pays)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.spans: list = []

    def measure(self, forwards) -> None:
        """Run `forwards()` and keep its span."""
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forwards()
            end.record()
            self.spans.append((start, end))
        else:
            start = time.perf_counter()
            forwards()
            self.spans.append(time.perf_counter() - start)

    def total(self) -> float:
        """The kept spans' seconds, summed (on a GPU once its queue has run them); the watch starts afresh."""
        if self.cuda:
            torch.cuda.synchronize()
            seconds = sum(start.elapsed_time(end) for start, end in self.spans) / 1e3
        else:
            seconds = sum(self.spans)
        self.spans = []
        return seconds


class _TimedForwards:
    """The forwards `forward_costs` times, over borrowed page tables with `context` tokens cached: each
    metadata built outside the timing, as the engine builds it before the forward."""

    def __init__(self, engine: Engine, pages: list[list[int]], context: int, k: int) -> None:
        self.engine, self.pages, self.context = engine, pages, context
        batch, page_size, device = len(pages), engine.config.page_size, engine.device
        self.watch = Stopwatch(device)
        self.draft_meta = build_page_metadata(pages, [1] * batch, [context + 1] * batch, page_size, device)
        self.verify_meta = build_page_metadata(pages, [k + 1] * batch, [context + k + 1] * batch, page_size, device)
        self.k = k
        self.ids = {q_len: torch.ones(batch * q_len, dtype=torch.long, device=device) for q_len in (1, k + 1)}
        self.rows = {q_len: torch.arange(batch * q_len, device=device) for q_len in (1, k + 1)}
        self.draft_inputs = self._head_inputs(batch)
        # a head's catch-up: every verify row, its output at each sequence's last (as MTPDrafter.propose);
        # a draft LM has none
        self.catch_up_rows = self.catch_up_meta = None
        if engine.drafter.one_layer:
            self.catch_up_rows = torch.arange(batch, device=device) * (k + 1) + k
            self.catch_up_meta = replace(self.verify_meta, output_rows=self.catch_up_rows)
            self.catch_up_inputs = self._head_inputs(batch * (k + 1))

    def _head_inputs(self, rows: int) -> dict:
        """A head's hidden-state input over `rows` rows (none for a draft LM)."""
        drafter = self.engine.drafter
        if not drafter.needs_hidden_states:
            return {}
        return {"hidden_states": torch.zeros(rows, self.engine.model.config.hidden_size, device=self.engine.device,
                                             dtype=drafter.runner.dtype)}

    def draft(self, meta: PageMetadata | None = None) -> None:
        """One draft forward: on `meta`, a step of a cycle's draft run, or on one step's metadata (`alone`)."""
        self.engine.drafter.runner.run(self.ids[1], self.draft_meta if meta is None else meta, self.rows[1],
                                       **self.draft_inputs)

    def catch_up(self) -> None:
        self.engine.drafter.runner.run(self.ids[self.k + 1], self.catch_up_meta, self.catch_up_rows,
                                       **self.catch_up_inputs)

    def verify(self) -> None:
        q_len = self.k + 1
        self.engine.runner.run(self.ids[q_len], self.verify_meta, self.rows[q_len],
                               aux_layers=self.engine.drafter.target_aux_layers)

    def decode_run(self, steps: int) -> float:
        """The mean seconds of a fresh decode run's forwards (its first step plans it)."""
        engine = self.engine
        run = DecodeSteps(self.pages, [self.context] * len(self.pages), steps, engine.config.page_size, engine.device)
        metas = [run.step(j) for j in range(steps)]

        def forwards() -> None:
            for meta in metas:
                engine.runner.run(self.ids[1], meta, self.rows[1])

        self.watch.measure(forwards)
        return self.watch.total() / steps

    def repeated(self, forward, times: int) -> float:
        def forwards() -> None:
            for _ in range(times):
                forward()

        self.watch.measure(forwards)
        return self.watch.total() / times

    @staticmethod
    def fastest_burst(repeats: int, burst, key=None):
        """The fastest of `repeats` bursts after a warm-up (by `key` where a burst returns several figures): noise
        on a shared machine only ever adds time."""
        burst()
        return min((burst() for _ in range(repeats)), key=key)

    def round(self, steps: int) -> ForwardCosts:
        """A decode run of `steps` forwards, then `steps` speculative cycles (`in_turns`)."""
        decode = self.decode_run(steps)
        return self.in_turns(steps, decode)

    def in_turns(self, cycles: int, decode: float) -> ForwardCosts:
        """The costs of `cycles` speculative cycles as a step runs them, each forward timed on its own (the mean of
        each kind), beside `decode`: a head's catch-up, K-1 drafts (one at K=1, for its price) and the verify; a
        draft LM's K drafts and the verify. Each cycle's drafts are the steps of a fresh `DecodeSteps` run, built
        outside the timing as `Drafter.draft` builds them, so the drafts pay the run's plan and masks as a step's
        do (one step's metadata, which no draft reads, would price them low)."""
        catch_ups, drafts, verifies = (Stopwatch(self.engine.device) for _ in range(3))
        with_catch_up = self.catch_up_rows is not None
        num_drafts = max(self.k - 1, 1) if with_catch_up else self.k
        engine = self.engine
        runs = [DecodeSteps(self.pages, [self.context] * len(self.pages), num_drafts, engine.config.page_size,
                            engine.device) for _ in range(cycles)]
        for run in runs:
            if with_catch_up:
                catch_ups.measure(self.catch_up)
            for meta in [run.step(j) for j in range(num_drafts)]:
                drafts.measure(functools.partial(self.draft, meta))
            verifies.measure(self.verify)
        return ForwardCosts(decode, drafts.total() / (cycles * num_drafts), verifies.total() / cycles,
                            catch_ups.total() / cycles if with_catch_up else None)
