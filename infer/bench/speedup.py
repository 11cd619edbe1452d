"""Speculative against plain decoding, timed in the same run, and the speedup that acceptance allows.

Both `python -m infer.bench --spec` and `mtp_train.validate` measure with these two functions:
  - `compare`: plain and speculative engines on the same prompts and sampling parameters, interleaved step by step
    (`interleaved_generate`: a spell of load on a shared machine hits both), the fastest of `repeats` giving the
    tokens/s, the median of the pairs' ratios the speedup, and the forward
    costs timed after each pair of runs (`timed_costs`);
  - `ideal_speedup`: what the measured tau and forward costs allow, with nothing lost to the machinery:

        ideal = tau * t(decode) / (t(drafting K) + t(verify over K+1))

    t(drafting K) being a step's drafter forwards: an MTP / EAGLE-3 head's catch-up over the K+1 verified rows (the
    first draft is its output) and K-1 drafts, a draft LM's K drafts (`ForwardCosts.drafting`); the forwards timed
    in turns, as a step runs them with nothing between them (`ForwardCosts`):
    so that achieved / ideal is the share of the ideal the runtime's machinery keeps (`IdealShare`: the median over
    repeats of each repeat's speedup over its own ideal), and what the two models cost each other in the core's
    caches is the forwards' own cost, not the machinery's;
  - `recommend_k`: the chain length K that maximises the predicted speedup at a batch size, from the conditional
    acceptance per draft position (measured once at the largest K: chain drafting is the same up to any smaller K),
    the measured cost of a draft forward and of the verify forward at each K, and each step's measured overhead o:

        tau(K) = 1 + sum_{j<=K} prod_{i<=j} a_i
        predicted(K) = tau(K) * (t(decode) + o_plain) / (t(drafting K) + t(verify over K+1) + o_spec(K))

    the forward costs and o measured at the batch size recommended for (`recommend_k_by_batch`: o from 128-token timed
    runs at K and at 1 there; `infer.bench` fits it from its own sweep at each batch size);
  - forward costs are timed at the timed runs' mean context (`cost_context`);
  - `interleaved_stream`: a stream of arrivals served by both engines, each on the clock of its own steps
    (`infer.bench --arrivals`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infer.bench.forward_costs import ForwardCosts, forward_costs
from infer.engine import Engine, Request, per_prompt
from infer.kv_cache import pages_needed
from infer.sampling_params import SamplingParams

SPEC_MIN_NEW_TOKENS = 2  # a request's first new token comes from its prefill; speculation verifies from the second
COST_CONTEXT = 32  # the fewest cached tokens behind the timed single forwards (engines are sized for at least this)


def timing_context(tokens: int, k: int, decode_run_steps: int) -> int:
    """The positions per sequence an engine that times forwards must hold: the longest context it runs (`tokens`,
    at least COST_CONTEXT), then a verify forward's K+1 (and a draft LM's one more) or the steps of a timed decode
    run (`forward_costs`)."""
    return max(tokens, COST_CONTEXT) + max(k + 2, decode_run_steps)


def cost_context(prompt_lens: Sequence[int], max_new_tokens: int) -> int:
    """The cached tokens behind the timed single forwards: the mean context of the timed runs (a prompt and half the
    tokens generated after it), so the ideal prices each forward where the runs met it: a verify forward's attention
    grows with the context faster than a decode's (see docs/benchmark_history.md)."""
    prompt_lens = list(prompt_lens)
    return max(COST_CONTEXT, round(sum(prompt_lens) / len(prompt_lens) + max_new_tokens / 2))


@dataclass
class Timed:
    seconds: float
    tokens: int  # generated tokens
    requests: list[Request]
    steps: int  # engine steps
    forward_s: float = 0.0  # of `seconds`, in model forwards (`Engine.forward_s`: a CPU figure)
    latency_s: float = 0.0  # a stream's mean time from a request's arrival to its last token (`interleaved_stream`)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def forward_ms_per_step(self) -> float:
        return 1e3 * self.forward_s / self.steps

    @property
    def host_ms_per_step(self) -> float:
        """A step's time outside the model forwards: scheduling, page metadata, sampling, acceptance, bookkeeping."""
        return 1e3 * (self.seconds - self.forward_s) / self.steps


def timed_generate(engine: Engine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]) -> Timed:
    """One batch run to completion."""
    start, steps, forward_s = time.perf_counter(), engine.num_steps, engine.forward_s
    requests = engine.generate(prompts, params)
    return Timed(time.perf_counter() - start, sum(len(r.output_ids) for r in requests), requests,
                 engine.num_steps - steps, engine.forward_s - forward_s)


def interleaved_generate(engines: Sequence[Engine], prompts: Sequence,
                         params: SamplingParams | Sequence[SamplingParams]) -> list[Timed]:
    """The same batch run to completion on every engine, their steps interleaved: the engine whose requests hold
    the smallest share of their new tokens steps next, so all runs spread over the same seconds and a spell of load
    on a shared machine falls on each in proportion to its time. Each run is timed step by step (requests are added
    before the clock starts).

    Runs of whole batches one after the other meet different spells, which spreads the ratio of a plain to a
    speculative run several times wider than interleaving by step does (see docs/benchmark_history.md)."""
    params = per_prompt(params, len(prompts))
    runs = [[engine.add_request(p, sp) for p, sp in zip(prompts, params)] for engine in engines]
    steps = [engine.num_steps for engine in engines]
    forward_s = [engine.forward_s for engine in engines]
    seconds = [0.0] * len(engines)
    live = [i for i, engine in enumerate(engines) if engine.has_unfinished()]

    def done(i: int) -> int:  # new tokens run i holds, a finished request counted whole
        return sum(r.params.max_new_tokens if r.finished else len(r.output_ids) for r in runs[i])

    while live:
        i = min(live, key=done)
        start = time.perf_counter()
        engines[i].step()
        seconds[i] += time.perf_counter() - start
        if not engines[i].has_unfinished():
            live.remove(i)
    return [Timed(seconds[i], sum(len(r.output_ids) for r in requests), requests, engine.num_steps - steps[i],
                  engine.forward_s - forward_s[i]) for i, (engine, requests) in enumerate(zip(engines, runs))]


def interleaved_stream(plain: Engine, other: Engine, prompts: Sequence, params: SamplingParams, count: int,
                       every: int) -> tuple[Timed, Timed]:
    """`count` requests (prompts in turn) arriving one every `every` steps of the plain engine; the other engine
    gets each at the same time on its own clock. Each engine's clock counts its own steps' seconds alone (and, for
    the other engine, waits for an arrival while it has nothing to run), and the engine whose clock is behind steps
    next: a spell of load on a shared machine meets both, as in `interleaved_generate`, and the other engine never
    steps past an arrival the plain one has not reached yet. Each run's seconds are its clock's."""
    engines, clocks = (plain, other), [0.0, 0.0]
    steps, forward_s = [e.num_steps for e in engines], [e.forward_s for e in engines]
    arrivals: list[float] = []  # on the plain engine's clock
    added: tuple[list[Request], list[Request]] = ([], [])
    arrived_at: tuple[dict[int, float], dict[int, float]] = ({}, {})  # request id -> arrival
    latency, tick = [0.0, 0.0], 0

    def add(i: int) -> None:
        request = engines[i].add_request(prompts[len(added[i]) % len(prompts)], params)
        arrived_at[i][request.request_id] = arrivals[len(added[i])]
        added[i].append(request)

    def ready(i: int) -> bool:  # has a step to take, or (the other engine) an arrival it knows of to wait for
        if engines[i].has_unfinished():
            return True
        return len(added[i]) < count if i == 0 else len(added[1]) < len(arrivals)

    while ready(0) or ready(1):
        i = min((j for j in (0, 1) if ready(j)), key=lambda j: clocks[j])
        if i == 0:
            if len(added[0]) < count and tick % every == 0:
                arrivals.append(clocks[0])
                add(0)
            tick += 1
        else:
            while len(added[1]) < len(arrivals) and arrivals[len(added[1])] <= clocks[1]:
                add(1)
            if not other.has_unfinished():  # idle until the next arrival
                clocks[1] = arrivals[len(added[1])]
                continue
        if engines[i].has_unfinished():
            start = time.perf_counter()
            finished = engines[i].step()
            clocks[i] += time.perf_counter() - start
            latency[i] += sum(clocks[i] - arrived_at[i][r.request_id] for r in finished)
    return tuple(Timed(clocks[i], sum(len(r.output_ids) for r in added[i]), added[i], engine.num_steps - steps[i],
                       engine.forward_s - forward_s[i], latency[i] / max(count, 1)) for i, engine in enumerate(engines))


@dataclass
class Comparison:
    plain: Timed  # the fastest plain run
    spec: Timed  # the fastest speculative run
    stats: dict  # the speculative engine's SpecStats over the timed runs
    pairs: list[tuple[Timed, Timed]]  # each repeat's plain and speculative runs, back to back
    on_cpu: bool = True  # the engines' device: their forwards' time is a CPU figure (`step_split`)

    @property
    def pair_speedups(self) -> list[float]:
        """Each repeat's speculative over plain tokens/s."""
        return [spec.tok_s / plain.tok_s for plain, spec in self.pairs]

    def step_split(self) -> dict[str, float | None]:
        """The fastest runs' steps split into model forwards and the host work around them, ms per step (what each
        means against the ideal: `infer.bench`'s help). None on a GPU, whose forwards return at launch."""
        split = {"plain_host_ms": self.plain.host_ms_per_step, "spec_forward_ms": self.spec.forward_ms_per_step,
                 "spec_host_ms": self.spec.host_ms_per_step}
        return {name: round(ms, 3) if self.on_cpu else None for name, ms in split.items()}


@dataclass
class IdealShare:
    """Medians over a comparison's repeats, each repeat priced by the forward costs timed right after it: a
    repeat's runs and its costs meet the machine at the same speed, where the fastest run and the fastest cost
    may come from different spells (a shared machine's speed drifts over minutes)."""

    speedup: float  # speculative over plain tokens/s
    ideal: float | None  # ideal_speedup at the repeat's forward costs; None: no costs were timed
    achieved_over_ideal: float | None

    @classmethod
    def of(cls, result: Comparison, costs: Sequence[ForwardCosts], k: int) -> "IdealShare":
        """costs[i]: timed after result.pairs[i] (`timed_costs`)."""
        return cls.of_ideals(result, [ideal_speedup(result.stats["tau"], c, k) for c in costs])

    @classmethod
    def speedup_only(cls, result: Comparison) -> "IdealShare":
        """The median speedup over the repeats, without an ideal (no forward costs timed)."""
        return cls(statistics.median(result.pair_speedups), None, None)

    @classmethod
    def of_ideals(cls, result: Comparison, ideals: Sequence[float]) -> "IdealShare":
        """ideals[i]: the ideal speedup at the forward costs timed after result.pairs[i]."""
        if len(ideals) != len(result.pairs):
            raise ValueError(f"{len(ideals)} forward-cost measurements for {len(result.pairs)} repeats")
        speedups = result.pair_speedups
        return cls(statistics.median(speedups), statistics.median(ideals),
                   statistics.median(s / i for s, i in zip(speedups, ideals)))


def compare(plain: Engine, spec: Engine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
            repeats: int, between: Callable[[Timed], None] | None = None) -> Comparison:
    """Timed runs of both engines, their steps interleaved (`interleaved_generate`); `between(plain run)` after
    each pair (the forward costs, timed within the same seconds as the runs: a shared machine's speed drifts over
    minutes). Speculation statistics are one timed run's: the repeats replay the same seeded requests, so
    counting them all would shrink the standard errors without new evidence."""
    plain_runs, spec_runs = [], []
    for _ in range(repeats):
        spec.reset_spec_stats()
        plain_run, spec_run = interleaved_generate((plain, spec), prompts, params)
        plain_runs.append(plain_run)
        spec_runs.append(spec_run)
        if between is not None:
            between(plain_runs[-1])
    fastest = lambda runs: min(runs, key=lambda run: run.seconds)  # noqa: E731
    return Comparison(fastest(plain_runs), fastest(spec_runs), spec.spec_stats.to_dict(),
                      list(zip(plain_runs, spec_runs)), spec.device.type == "cpu")


def timed_costs(spec: Engine, batch_size: int, max_new_tokens: int, repeats: int = 8,
                alone: bool = False) -> tuple[list[ForwardCosts], Callable[[Timed], None]]:
    """A `compare(between=...)` that times the forward costs after each pair of runs, at the runs' mean context
    (`cost_context`), into the list it returns: `IdealShare.of` prices each repeat by its own, `ForwardCosts.fastest`
    of them is the costs to report. alone: also each model's forwards back to back (`ForwardCosts.alone`)."""
    measured: list[ForwardCosts] = []

    def between(run: Timed) -> None:
        context = cost_context([len(r.prompt_ids) for r in run.requests], max_new_tokens)
        measured.append(forward_costs(spec, batch_size, context, repeats, alone=alone))

    return measured, between


def ideal_speedup(tau: float, costs: ForwardCosts, k: int) -> float:
    return tau * costs.decode / (costs.drafting(k) + costs.verify)


def live_per_verify_step(requests: Sequence[Request]) -> list[int]:
    """The requests still speculating at each verify step of a batch that started together (one prefill step,
    then every step speculating: request i verifies at steps 1..n_i, n_i its own verify steps)."""
    steps = [r.spec_stats.verify_steps for r in requests]
    return [sum(n >= step for n in steps) for step in range(1, max(steps, default=0) + 1)]


def ideal_speedup_with_tail(live: Sequence[int], decode_steps: int, full: ForwardCosts, single: ForwardCosts,
                            k: int) -> float:
    """The ideal speedup of a batch whose requests accept differently: the plain batch's `decode_steps` decodes at
    the full batch against each verify step priced at the batch it still held (`live_per_verify_step`), the forward
    costs linear between batch 1 (`single`) and the full batch (`full`). A batch whose requests all take the same
    steps at tau gets `ideal_speedup`; one that ends in a shrinking tail gets the tail's steps at their own price,
    which no runtime machinery removes."""
    size = live[0]

    def step_cost(batch: int) -> float:
        w = (batch - 1) / (size - 1) if size > 1 else 1.0
        return (1 - w) * (single.drafting(k) + single.verify) + w * (full.drafting(k) + full.verify)

    return decode_steps * full.decode / sum(step_cost(batch) for batch in live)


@dataclass
class StepOverhead:
    """Seconds per engine step beyond its forwards (scheduling, metadata, plans, sampling, bookkeeping), measured.

    A speculative step's overhead grows with K (each draft forward has its own metadata, plan and sampling), so it
    is a line a + b * K through the Ks measured (flat when one K was measured)."""

    plain: float = 0.0  # a plain decode step beyond its target forward
    spec: float = 0.0  # a speculative step beyond its K draft forwards and its verify forward: a ...
    spec_per_draft: float = 0.0  # ... + b * K

    def spec_at(self, k: int) -> float:
        return max(self.spec + self.spec_per_draft * k, 0.0)

    @classmethod
    def fitted(cls, measured: dict[int, tuple[float, float, float]], costs: dict[int, ForwardCosts],
               batch_size: int) -> "StepOverhead":
        """From timed runs per K: {K: (plain tok/s, speculative tok/s, tau)}, each K with its forward costs. A
        plain step emits batch_size tokens, a speculative one batch_size * tau."""
        plain = [batch_size / plain_tok_s - costs[k].decode for k, (plain_tok_s, _, _) in measured.items()]
        spec = {k: batch_size * tau / spec_tok_s - costs[k].drafting(k) - costs[k].verify
                for k, (_, spec_tok_s, tau) in measured.items()}
        low, high = min(spec), max(spec)
        slope = (spec[high] - spec[low]) / (high - low) if high > low else 0.0
        return cls(max(sum(plain) / len(plain), 0.0), spec[low] - slope * low, slope)


def predicted_speedup(tau: float, costs: ForwardCosts, k: int, overhead: StepOverhead) -> float:
    """The ideal speedup once each step's measured overhead is added to both sides."""
    return tau * (costs.decode + overhead.plain) / (costs.drafting(k) + costs.verify + overhead.spec_at(k))


def predicted_tau(conditional: list[float], k: int) -> float:
    """Tokens per target forward for chain drafting of k tokens, from the conditional acceptance per position."""
    tau, reach = 1.0, 1.0
    for rate in conditional[:k]:
        reach *= rate
        tau += reach
    return tau


@dataclass
class Recommendation:
    k: int  # 0: decode plainly, no K is predicted to beat it
    predicted_speedup: dict[int, float]  # K -> speedup over plain decoding

    @property
    def best_k(self) -> int:
        """The K with the highest predicted speedup, even where that is below 1 (what a measured sweep checks)."""
        return max(self.predicted_speedup, key=self.predicted_speedup.get)

    def to_dict(self) -> dict:
        return {"k": self.k, "predicted_speedup": {str(k): round(v, 3) for k, v in self.predicted_speedup.items()}}


def recommend_k(conditional: list[float], costs: dict[int, ForwardCosts],
                overhead: StepOverhead | None = None) -> Recommendation:
    """The K in `costs` (each with its own verify cost) with the highest predicted speedup, or 0 where none is predicted
    to beat plain decoding (a small model's forward costs about the same at any width, so at larger batches on a CPU
    every K can lose: recommending the least bad K would have the runtime speculate slower than it decodes)."""
    usable = {k: c for k, c in costs.items() if k <= len(conditional)}
    if not usable:
        raise ValueError(f"no K in {sorted(costs)} is covered by acceptance measured at {len(conditional)} positions")
    overhead = overhead or StepOverhead()
    speedup = {k: predicted_speedup(predicted_tau(conditional, k), c, k, overhead) for k, c in sorted(usable.items())}
    best = max(speedup, key=speedup.get)
    return Recommendation(best if speedup[best] > 1 else 0, speedup)


TIMING_TOKENS = 128  # tokens per request in the timed runs behind a recommendation's step overhead


@dataclass
class TimingEngines:
    """What a recommendation times, sized for its largest batch: plain decoding, and speculation at K and at K=1
    (the step overhead is a line in K through both; None when K is 1)."""

    plain: Engine
    spec: Engine
    spec_k1: Engine | None


def timing_engines(spec: Engine, batch_sizes: Sequence[int], longest_prompt: int) -> TimingEngines:
    """Engines of `spec`'s model and drafter with pages for the largest batch of prompts up to `longest_prompt`
    tokens (and for the forward costs). Built apart from the measurement: under tensor parallelism every rank builds
    them (rank 0 alone then times them)."""
    k = spec.num_draft_tokens
    context = timing_context(longest_prompt + TIMING_TOKENS, k, spec.config.decode_run_steps)
    sizes = dict(num_pages=max(batch_sizes) * pages_needed(context, spec.config.page_size) + 1,
                 max_num_seqs=max(batch_sizes))
    plain = spec.with_config(**sizes, num_draft_tokens=k)

    def speculating(num_draft_tokens: int) -> Engine:
        engine = plain.with_config(num_draft_tokens=num_draft_tokens)
        engine.attach_drafter(spec.drafter.kind, spec.drafter.runner.model)
        return engine

    return TimingEngines(plain, speculating(k), speculating(1) if k > 1 else None)


def step_overhead_at(engines: TimingEngines, prompts: Sequence, batch_size: int, costs: dict[int, ForwardCosts],
                     temperature: float = 0.0) -> StepOverhead:
    """The step overhead at `batch_size`: plain and speculative runs (at K and at 1) of batch_size of `prompts`
    (cycled), TIMING_TOKENS each, timed against `costs` (K -> the forward costs at that batch size). Measured per
    batch size: the overhead grows with the batch (per-request bookkeeping, larger metadata), so one batch's would
    misprice another."""
    batch = [prompts[i % len(prompts)] for i in range(batch_size)]
    params = [SamplingParams(max_new_tokens=TIMING_TOKENS, ignore_eos=True, temperature=temperature, seed=i)
              for i in range(batch_size)]
    timed_generate(engines.plain, batch[:1], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    measured = {}
    for spec in (engines.spec, engines.spec_k1):
        if spec is None:
            continue
        k = spec.num_draft_tokens
        timed_generate(spec, batch[:1], SamplingParams(max_new_tokens=k + 4, ignore_eos=True))
        result = compare(engines.plain, spec, batch, params, repeats=1)
        measured[k] = (result.plain.tok_s, result.spec.tok_s, result.stats["tau"])
    return StepOverhead.fitted(measured, {k: costs[k] for k in measured}, batch_size)


def recommend_k_by_batch(engines: TimingEngines, conditional: list[float], batch_sizes: Sequence[int],
                         prompts: Sequence, temperature: float = 0.0, repeats: int = 10) -> dict[str, dict]:
    """batch size -> the recommended K and the predicted speedup at every K up to the measured one, from forward
    costs and the step overhead (`step_overhead_at`) measured here at that batch size on `engines` (timing_engines).
    conditional: SpecStats' conditional acceptance (0 at a position never reached: nothing known accepts there),
    measured at the engines' K (= its length); prompts: token ids."""
    out = {}
    for batch_size in batch_sizes:
        context = cost_context([len(prompts[i % len(prompts)]) for i in range(batch_size)], TIMING_TOKENS)
        costs = {k: forward_costs(engines.spec, batch_size, context, repeats, num_draft_tokens=k)
                 for k in range(1, len(conditional) + 1)}
        overhead = step_overhead_at(engines, prompts, batch_size, costs, temperature)
        out[str(batch_size)] = recommend_k(conditional, costs, overhead).to_dict()
    return out
