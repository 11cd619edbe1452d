"""A request as the engine holds it: its tokens, sampling parameters, pages, progress and outcome."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from infer.kv_cache import PageTable
from infer.sampling_params import SamplingParams
from infer.speculative import SpecStats


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    page_table: PageTable
    prompt: str | None = None
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    finish_reason: str | None = None  # "stop" (EOS id or stop string) or "length"
    text: str = ""
    stopped_by_string: bool = False  # text was cut before a stop string
    prompt_text_decoded: str | None = None  # the prompt as the tokenizer decodes it, to cut from the full text
    num_preemptions: int = 0
    spec_stats: SpecStats | None = None  # with a drafter attached
    arrival_time: float = field(default_factory=time.perf_counter)
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = self.prompt_ids + self.output_ids  # prompt then output, grown as tokens are sampled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def elapsed_s(self) -> float:
        return (self.finish_time or time.perf_counter()) - self.arrival_time


def per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> Sequence[SamplingParams]:
    """Sampling parameters for each of `count` prompts: one set for all (the defaults when None), or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    return params
