"""/metrics in Prometheus' text format: read from the engine and its loop at each scrape (a collector of its own
registry, so several servers in one process do not collide)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from infer.serve.engine_loop import EngineLoop

PREFIX = "infer"


class EngineCollector(Collector):
    def __init__(self, loop: EngineLoop, model_name: str) -> None:
        self.loop, self.model_name = loop, model_name

    def collect(self) -> Iterator[Metric]:
        engine, stats, labels = self.loop.engine, self.loop.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        pool = engine.pool
        yield gauge("num_requests_running", "requests in the running batch", len(engine.running))
        yield gauge("num_requests_waiting", "requests queued for admission", len(engine.waiting))
        yield gauge("kv_pages_used", "KV cache pages held by requests", pool.num_pages - pool.num_free)
        yield gauge("kv_pages_total", "KV cache pages in the pool", pool.num_pages)
        yield gauge("generation_tokens_per_second", "tokens generated per second over the last 10 s",
                    stats.tokens_per_s())
        yield counter("prompt_tokens", "prompt tokens of queued requests", stats.prompt_tokens)
        yield counter("generation_tokens", "tokens generated", stats.generation_tokens)
        yield counter("engine_steps", "engine steps run", stats.steps)
        yield counter("engine_step_seconds", "seconds in engine steps", stats.step_s)
        finished = CounterMetricFamily(f"{PREFIX}_requests_finished", "requests that ended, by finish reason",
                                       labels=["model_name", "finish_reason"])
        for reason, count in sorted(dict(stats.finished).items()):
            finished.add_metric([self.model_name, reason], count)
        yield finished
        spec = engine.spec_stats
        if spec is None:
            return
        summary = spec.to_dict()
        yield gauge("spec_tau", "tokens per verify step while speculating", summary["tau"])
        yield gauge("spec_speculated_share", "share of decode steps that verified drafts", summary["speculated_share"])
        yield gauge("spec_num_draft_tokens", "largest K drafted per step", spec.num_draft_tokens)
        yield counter("spec_verify_steps", "target steps that verified drafts", spec.verify_steps)
        acceptance = GaugeMetricFamily(f"{PREFIX}_spec_conditional_acceptance",
                                       "accepted at draft position j / steps that reached j",
                                       labels=["model_name", "position"])
        for j, rate in enumerate(summary["conditional_acceptance"]):
            acceptance.add_metric([self.model_name, str(j + 1)], rate)
        yield acceptance


def registry_for(loop: EngineLoop, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(loop, model_name))
    return registry
