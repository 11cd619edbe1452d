"""The serving engine: a request queue, continuous batching over the paged KV cache, sampling and stopping.

Every step the scheduler (`scheduler`) packs one batch under a token budget and a page budget: running requests
first (decode is one token; a long prompt is prefilled in chunks), then waiting requests while budget and pages
last. When pages run out, the most recently admitted request is preempted: its pages are freed and it is requeued
to be recomputed later, so the engine never crashes for lack of memory. The step's rows go through one packed
target forward (`forward`); a batch of decodes that stays the same takes its steps from a decode run the runner
plans at once (`infer.model_runner.DecodeRuns`). The sampled tokens are appended and the stops decided (`output`).

With a drafter attached, the decodes that can speculate take one `infer.speculative.speculative_decode` round,
their verify rows packed in the same forward as the other rows; after every target forward the drafter is handed
the forward's rows once (`Drafter.propose`). The loop (`loop.Engine.step`) owns everything a round changes:
tokens, stops, page tables and statistics.
"""

from infer.engine.loop import Engine, EngineConfig
from infer.engine.request import Request, per_prompt

__all__ = ["Engine", "EngineConfig", "Request", "per_prompt"]
