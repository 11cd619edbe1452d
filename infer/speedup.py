"""Speculative against plain decoding, timed in the same run, and the speedup that acceptance allows.

Both `python -m infer.bench --spec` and `mtp_train.validate` measure with these two functions:
  - `compare`: plain and speculative engines on the same prompts and sampling parameters, interleaved run by run
    (so a burst of load on a shared machine hits both), the fastest of `repeats` counting;
  - `ideal_speedup`: what the measured tau and forward costs allow, with nothing lost to the machinery:

        ideal = tau * t(decode) / (K * t(draft) + t(verify over K+1))

    so that achieved / ideal is the share of the ideal the runtime keeps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from infer.engine import Engine, ForwardCosts, Request
from infer.sampling_params import SamplingParams

COST_CONTEXT = 32  # cached tokens behind the timed single forwards


@dataclass
class Timed:
    seconds: float
    tokens: int  # generated tokens
    requests: list[Request]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def timed_generate(engine: Engine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams]) -> Timed:
    """One batch run to completion."""
    start = time.perf_counter()
    requests = engine.generate(prompts, params)
    return Timed(time.perf_counter() - start, sum(len(r.output_ids) for r in requests), requests)


@dataclass
class Comparison:
    plain: Timed  # the fastest plain run
    spec: Timed  # the fastest speculative run
    stats: dict  # the speculative engine's SpecStats over the timed runs

    @property
    def speedup(self) -> float:
        return self.spec.tok_s / self.plain.tok_s


def compare(plain: Engine, spec: Engine, prompts: Sequence, params: SamplingParams | Sequence[SamplingParams],
            repeats: int) -> Comparison:
    """Interleaved timed runs of both engines; speculation statistics count the timed runs only."""
    spec.reset_spec_stats()
    plain_runs, spec_runs = [], []
    for _ in range(repeats):
        plain_runs.append(timed_generate(plain, prompts, params))
        spec_runs.append(timed_generate(spec, prompts, params))
    fastest = lambda runs: min(runs, key=lambda run: run.seconds)  # noqa: E731
    return Comparison(fastest(plain_runs), fastest(spec_runs), spec.spec_stats.to_dict())


def ideal_speedup(tau: float, costs: ForwardCosts, k: int) -> float:
    return tau * costs.decode / (k * costs.draft + costs.verify)
