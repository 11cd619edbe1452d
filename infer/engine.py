"""The serving loop: a request queue, continuous batching over the paged KV cache, sampling and stopping.

Every step the scheduler packs one batch under a token budget and a page budget: running requests first
(decode is one token; a long prompt is prefilled in chunks), then waiting requests while budget and pages
last. When pages run out, the most recently admitted request is preempted: its pages are freed and it is
requeued to be recomputed later, so the engine never crashes for lack of memory. A batch of decodes that stays the
same is planned in runs of `decode_run_steps` steps: one page-metadata build and one attention plan per run.

With a drafter attached, the decodes that can speculate take one `infer.speculative.speculative_decode` round,
their verify rows packed in the same forward as the other rows; after every target forward the drafter is handed
the forward's rows once (`Drafter.propose`). The engine owns everything a round changes: tokens, stops, page tables
and statistics.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from infer.attention import kv_buckets
from infer.kv_cache import DecodeSteps, OutOfPages, PagePool, PageMetadata, PageTable, build_page_metadata, pages_needed
from infer.loader import default_eos_ids, load_model, load_tokenizer
from infer.model_runner import ModelRunner
from infer.models.mtp_head import DRAFTER_KINDS, load_head
from infer.sampler import SamplingTensors, make_generator, sample
from infer.sampling_params import SamplingParams
from infer.speculative import DRAFTERS, Drafter, SpecStats, TargetRows, emitted_lists, speculative_decode


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


@dataclass
class _PlainRows:
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


@dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: enough for max_num_seqs full-context sequences, within kv_cache_bytes
    kv_cache_bytes: int = 4 << 30
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    backend: str = "auto"
    num_draft_tokens: int = 4  # K, when a drafter is attached
    decode_run_steps: int = 16  # plain decode steps whose metadata and attention plan are built at once (1: per step)


# decode runs for batches up to this: beyond, the batch changes every few steps and a run costs more than it saves
# (see docs/benchmark_history.md)
DECODE_RUN_MAX_SEQS = 32


@dataclass
class _DecodeRun:
    """Plain decode steps planned at once (Engine._decode_run_meta): the batch's requests in order, their kv lengths
    at the run's first step, and the next step to serve."""

    steps: DecodeSteps
    request_ids: list[int]
    first_kv_lens: list[int]
    next: int = 1


class Engine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase | None = None,
        eos_token_ids: Iterable[int] = (),
        config: EngineConfig | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = model.config.max_position_embeddings
        param = next(model.parameters())
        self.device = param.device
        cfg = self.config
        if cfg.max_num_batched_tokens < 1 or cfg.max_num_seqs < 1 or cfg.decode_run_steps < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs and decode_run_steps must be >= 1")
        num_pages = cfg.num_pages or self._default_num_pages(param.dtype)
        self.pool = PagePool(num_pages, cfg.page_size)
        self.runner = ModelRunner(model, num_pages, cfg.page_size, cfg.backend)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._next_id = 0
        self.num_steps = 0
        self.drafter: Drafter | None = None
        self.num_draft_tokens = cfg.num_draft_tokens
        self._decode_run: _DecodeRun | None = None
        self._run_steps = cfg.decode_run_steps  # the next decode run's length (see _decode_run_meta)
        self.spec_stats: SpecStats | None = None

    def load_drafter(self, kind: str, path: str | Path) -> None:
        """Attach a draft LM folder (kind "draft") or a head folder (kind "mtp": the head's architecture picks its
        drafter, MTP / EAGLE-1 or EAGLE-3) from disk."""
        if kind == "draft":
            param = next(self.model.parameters())
            model = load_model(path, dtype=param.dtype, device=param.device)
        else:
            model = load_head(path, self.model)
            kind = DRAFTER_KINDS[model.config.architecture]
        self.attach_drafter(kind, model)

    def attach_drafter(self, kind: str, model: torch.nn.Module) -> None:
        """Speculate with a draft LM (kind "draft"), an MTP / EAGLE-1 head ("mtp") or an EAGLE-3 head ("eagle3") on
        the engine's own pages."""
        if self.has_unfinished():
            raise RuntimeError("attach a drafter before adding requests")
        if self.num_draft_tokens < 1:
            raise ValueError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if model.config.vocab_size != self.model.config.vocab_size:
            raise ValueError(
                f"the drafter's vocabulary ({model.config.vocab_size}) differs from the target's "
                f"({self.model.config.vocab_size}): it must share the target's tokenizer"
            )
        architecture = getattr(model.config, "architecture", None)
        if kind != "draft" and DRAFTER_KINDS.get(architecture) != kind:
            raise ValueError(f"a {architecture} head drafts as kind {DRAFTER_KINDS.get(architecture)!r}, not {kind!r}")
        devices = {p.device for p in model.parameters()}
        if devices != {self.runner.device}:
            raise ValueError(f"the drafter's weights are on {', '.join(sorted(map(str, devices)))} and the target's on "
                             f"{self.runner.device}: move the drafter to the target's device first")
        self.drafter = DRAFTERS[kind](model, self.pool.num_pages, self.config.page_size, self.config.backend)
        self.reset_spec_stats()

    @property
    def forward_s(self) -> float:
        """Seconds in the target's and the drafter's forwards so far (`ModelRunner.forward_s`: on a GPU, only the
        launches)."""
        return self.runner.forward_s + (self.drafter.runner.forward_s if self.drafter is not None else 0.0)

    def reset_spec_stats(self) -> None:
        """Count speculation afresh from here (e.g. after a warm-up run)."""
        self.spec_stats = SpecStats(self.num_draft_tokens) if self.drafter else None

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", **config_kwargs
    ) -> "Engine":
        path = Path(path)
        model = load_model(path, dtype=dtype, device=device)
        return cls(model, load_tokenizer(path), default_eos_ids(path, model.config), EngineConfig(**config_kwargs))

    def with_config(self, **changes) -> "Engine":
        """Another engine (own pages, no requests, no drafter) on this one's model, tokenizer and stop ids."""
        return Engine(self.model, self.tokenizer, self.eos_token_ids, replace(self.config, **changes))

    def _default_num_pages(self, dtype: torch.dtype) -> int:
        per_page = self.model.kv_bytes_per_token(dtype) * self.config.page_size
        wanted = self.config.max_num_seqs * pages_needed(self.max_model_len, self.config.page_size)
        return max(1, min(wanted, self.config.kv_cache_bytes // per_page))

    # --- requests ---------------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Request:
        """Queue a prompt (text, or token ids); raises ValueError naming what is wrong with it."""
        params = params or SamplingParams()
        params.validate(self.model.config.vocab_size)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token ids instead of text")
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt, verbose=False)
        else:
            prompt_text, prompt_ids = None, [int(t) for t in prompt]
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must lie in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len} "
                "(max_position_embeddings), which leaves no room to generate"
            )
        longest = min(len(prompt_ids) + params.max_new_tokens, self.max_model_len)
        if pages_needed(longest, self.config.page_size) > self.pool.num_pages:
            raise ValueError(
                f"a request of {len(prompt_ids)} prompt + {params.max_new_tokens} new tokens needs "
                f"{pages_needed(longest, self.config.page_size)} KV pages; the cache has {self.pool.num_pages} "
                f"of {self.config.page_size} tokens (raise num_pages or lower max_new_tokens)"
            )
        stop_ids = frozenset() if params.ignore_eos else frozenset(
            params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids
        )
        request = Request(
            request_id=self._next_id,
            prompt_ids=prompt_ids,
            params=params,
            stop_ids=stop_ids,
            generator=make_generator(params.seed, self.device),
            page_table=PageTable(self.pool),
            prompt=prompt_text,
            spec_stats=SpecStats(self.num_draft_tokens) if self.drafter else None,
        )
        self._next_id += 1
        self.waiting.append(request)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling -------------------------------------------------------------------------------
    def _preempt_newest(self) -> Request:
        victim = self.running.pop()
        victim.page_table.free()
        victim.num_computed = 0
        if self.drafter is not None:
            self.drafter.forget(victim.request_id)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def _schedule(self) -> list[tuple[Request, int]]:
        """Pick (request, number of new tokens) pairs for this step under the token and page budgets."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            q_len = min(request.num_tokens - request.num_computed, budget)
            try:
                request.page_table.extend(request.num_computed + q_len)
            except OutOfPages:
                if self._preempt_newest() is request:
                    break
                continue  # a page was freed: retry the same request
            scheduled.append((request, q_len))
            budget -= q_len
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            q_len = min(request.num_tokens - request.num_computed, budget)
            # Admit only when the pool can also hold the next decode token: no immediate preemption.
            if request.page_table.pages_to_grow(request.num_computed + q_len + 1) > self.pool.num_free:
                break
            request.page_table.extend(request.num_computed + q_len)
            self.waiting.popleft()
            self.running.append(request)
            scheduled.append((request, q_len))
            budget -= q_len
        return scheduled

    # --- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        With a drafter attached, the decodes that can speculate verify K drafts in the same forward as the others'
        prefill chunks and plain decodes (verify rows packed after them); the drafter is then handed every row of
        that forward, before the host reads what was sampled or accepted.
        """
        scheduled = self._schedule()
        if not scheduled:
            if self.waiting:
                raise RuntimeError("no request fits in the KV cache; raise num_pages or lower max_num_seqs")
            return []
        self.num_steps += 1
        speculating = self._speculating(scheduled)
        chosen = {r.request_id for r in speculating}
        rows = _PlainRows([(r, q) for r, q in scheduled if r.request_id not in chosen])
        if self.spec_stats is not None:
            self.spec_stats.plain_decodes += rows.num_decodes

        forward = _TargetForward(self, rows, speculating)
        start, drafter_s = time.perf_counter(), self.drafter.seconds if self.drafter else 0.0
        emitted = num_emitted = None
        if speculating:
            sampling = SamplingTensors.from_params([r.params for r in speculating], self.device)
            emitted, num_emitted = speculative_decode(forward, self.drafter, speculating, self.num_draft_tokens,
                                                      sampling, [r.generator for r in speculating])
        else:
            forward(None)
        sampled = None
        if rows.sample_rows:
            requests = [r for r, _ in rows.sampling]
            tensors = SamplingTensors.from_params([r.params for r in requests], self.device)
            sampled = sample(forward.output.logits[: len(requests)], tensors, [r.generator for r in requests])
        if self.drafter is not None:
            self.drafter.propose(forward.target_rows(sampled, emitted, num_emitted))
        finished = []
        if sampled is not None:  # the host reads the step's tokens only now: the drafter is launched
            finished = [r for (r, _), token in zip(rows.sampling, sampled.tolist()) if self._append_token(r, token)]
        if speculating:
            self._record_spec_time(speculating, time.perf_counter() - start, self.drafter.seconds - drafter_s)
            self._settle_speculation(speculating, emitted_lists(emitted), finished)
        return self._finish_step(finished)

    def _decode_run_meta(self, rows: "_PlainRows") -> PageMetadata | None:
        """A batch of one-token rows takes its step of a run of `decode_run_steps` decode steps built at once
        (`DecodeSteps`: one metadata build and one attention plan for the run instead of one per step; each step
        reads the run's last step's pages, masked), while the batch stays the same requests in the same order.

        A new run reserves the pages its steps write. None (a step built alone) for other batches, with a drafter
        attached (it owns the page tables' tails), when the pool cannot hold the run's pages, past DECODE_RUN_MAX_SEQS
        sequences (where a step's plan is a small share of it and the batch changes every few steps), and on the
        torch backend where the batch's keys would be split by length (`kv_buckets`: a run attends as one group,
        padded to its longest). A run lasts up to twice as many steps as the last one served (up to
        decode_run_steps), so runs stay about as short as the batch stays the same.
        """
        run = self._decode_run
        if run is not None:
            if (run.next < run.steps.num_steps and [r.request_id for r, _ in rows.scheduled] == run.request_ids
                    and rows.kv_lens == [kv + run.next for kv in run.first_kv_lens]):
                run.next += 1
                return run.steps.step(run.next - 1)
            self._decode_run, self._run_steps = None, min(2 * run.next, self.config.decode_run_steps)
        if self.config.decode_run_steps == 1 or self.drafter is not None or rows.num_tokens != len(rows.scheduled):
            return None
        batch = len(rows.kv_lens)
        if batch > DECODE_RUN_MAX_SEQS or (self.runner.backend_name == "torch"
                                           and len(kv_buckets(list(range(batch)), rows.kv_lens)) > 1):
            return None
        requests = [r for r, _ in rows.scheduled]
        # the run ends where the first request would stop for length (an earlier stop ends it too) or meet the
        # context's end
        steps = min(self._run_steps, *(r.params.max_new_tokens - len(r.output_ids) for r in requests),
                    *(self.max_model_len - kv + 1 for kv in rows.kv_lens))
        ends = [kv + steps - 1 for kv in rows.kv_lens]
        if steps <= 1 or sum(r.page_table.pages_to_grow(end) for r, end in zip(requests, ends)) > self.pool.num_free:
            return None
        for request, end in zip(requests, ends):
            request.page_table.extend(end)
        run = self._decode_run = _DecodeRun(DecodeSteps(rows.page_lists, [kv - 1 for kv in rows.kv_lens], steps,
                                                        self.config.page_size, self.device),
                                            [r.request_id for r in requests], rows.kv_lens)
        return run.steps.step(0)

    def _settle_speculation(self, requests: list[Request], emitted: list[list[int]], finished: list[Request]) -> None:
        """Append each request's emitted tokens and record acceptance; the rejected drafts' pages go back."""
        for request, tokens in zip(requests, emitted):
            request.spec_stats.record(len(tokens) - 1)
            self.spec_stats.record(len(tokens) - 1)
            if self._append_verified(request, tokens):
                finished.append(request)
            else:
                request.page_table.truncate(request.num_computed)

    def _record_spec_time(self, requests: list[Request], step_s: float, draft_s: float) -> None:
        """A speculative step's seconds up to the host's read: the drafter's (drafts and catch-up), the rest the
        verify's."""
        share = 1.0 / len(requests)
        for request in requests:
            request.spec_stats.draft_time_s += draft_s * share
            request.spec_stats.verify_time_s += (step_s - draft_s) * share
        self.spec_stats.draft_time_s += draft_s
        self.spec_stats.verify_time_s += step_s - draft_s

    def _speculating(self, scheduled: list[tuple[Request, int]]) -> list[Request]:
        """The decodes that verify K drafts this step: the step's token budget, the context and the page pool have
        room for K more tokens each (their pages are reserved here). The drafter has seen every position before
        their pending token (it reads every target forward's rows), so it can draft for them."""
        if self.drafter is None:
            return []
        k = self.num_draft_tokens
        budget = self.config.max_num_batched_tokens - sum(q_len for _, q_len in scheduled)
        chosen = []
        for request, q_len in scheduled:
            # a request's first forward (a one-token prompt) is plain: the drafter has seen none of it yet
            if (budget < k or q_len != 1 or request.num_tokens - request.num_computed != 1 or not request.num_computed
                    or request.num_tokens + k >= self.max_model_len):
                continue
            # verify writes K+1 positions; the drafts, fewer
            if request.page_table.pages_to_grow(request.num_tokens + k) > self.pool.num_free:
                continue
            request.page_table.extend(request.num_tokens + k)
            budget -= k
            chosen.append(request)
        return chosen

    def _finish_step(self, finished: list[Request]) -> list[Request]:
        if finished:
            self.running = [r for r in self.running if not r.finished]
        return finished

    def _append_token(self, request: Request, token: int, settle: bool = False) -> bool:
        """Record a sampled token and decide whether the request stops; frees its pages when it does.

        settle: the token follows a verified position, so everything before it is now in the cache.
        """
        if settle:
            request.num_computed = request.num_tokens
        request.output_ids.append(token)
        request.token_ids.append(token)
        params = request.params
        if token in request.stop_ids:
            request.finish_reason = "stop"
        elif params.stop and self._hit_stop_string(request):
            request.finish_reason = "stop"
        elif len(request.output_ids) >= params.max_new_tokens or request.num_tokens >= self.max_model_len:
            request.finish_reason = "length"
        return request.finish_reason is not None and self._finish(request)

    def _append_verified(self, request: Request, tokens: list[int]) -> bool:
        """`_append_token(request, token, settle=True)` for each of a verify step's emitted tokens in turn, up to the
        first that stops the request, in one pass (a speculating step settles some B * tau tokens; the stop
        strings alone need the text after every token)."""
        if request.params.stop:
            return any(self._append_token(request, token, settle=True) for token in tokens)
        # the last token kept: the first stop token, or the one that reaches a length limit (a stop wins a tie)
        room = max(1, min(request.params.max_new_tokens - len(request.output_ids),
                          self.max_model_len - request.num_tokens))
        stop = next((j for j, token in enumerate(tokens) if token in request.stop_ids), len(tokens))
        last = min(stop, room - 1, len(tokens) - 1)
        kept = tokens[: last + 1]
        request.num_computed = request.num_tokens + last  # every position before the last kept token is settled
        request.output_ids.extend(kept)
        request.token_ids.extend(kept)
        if last == stop:
            request.finish_reason = "stop"
        elif last == room - 1:
            request.finish_reason = "length"
        return request.finish_reason is not None and self._finish(request)

    def _finish(self, request: Request) -> bool:
        """A request that just stopped: its time, pages, drafter state and text. True."""
        request.finish_time = time.perf_counter()
        request.page_table.free()
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        if self.tokenizer is not None and not request.stopped_by_string:
            request.text = self._output_text(request)
        return True

    def _output_text(self, request: Request) -> str:
        """The generated text as it reads after the prompt (decoded together: a leading space survives)."""
        decode = self.tokenizer.decode
        if request.prompt_text_decoded is None:
            request.prompt_text_decoded = decode(request.prompt_ids, skip_special_tokens=True)
        full = decode(request.token_ids, skip_special_tokens=True)
        prefix = request.prompt_text_decoded
        return full[len(prefix):] if full.startswith(prefix) else decode(request.output_ids, skip_special_tokens=True)

    def _hit_stop_string(self, request: Request) -> bool:
        text = self._output_text(request) if self.tokenizer else ""
        hits = [i for i in (text.find(s) for s in request.params.stop) if i >= 0]
        if hits:
            request.text = text[: min(hits)]
            request.stopped_by_string = True
        return bool(hits)

    # --- convenience ------------------------------------------------------------------------------
    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: bool = False,
    ) -> list[Request]:
        """Run prompts to completion; returns their requests in prompt order."""
        params = per_prompt(params, len(prompts))
        requests = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        bar = None
        if progress:
            from tqdm import tqdm  # noqa: PLC0415 - only the CLI wants a bar

            bar = tqdm(total=len(requests), desc="generate", unit="req", dynamic_ncols=True)
        while self.has_unfinished():
            done = self.step()
            if bar is not None and done:
                bar.update(len(done))
        if bar is not None:
            bar.close()
        return requests


class _TargetForward:
    """A step's one target forward: the plain rows, then K+1 verify rows per speculating request; called with the
    verify ids by `speculative_decode` (or with None), it keeps what the drafter reads of it (`target_rows`)."""

    def __init__(self, engine: Engine, rows: _PlainRows, speculating: list[Request]) -> None:
        self.engine, self.rows, self.speculating = engine, rows, speculating

    def __call__(self, verify_ids: torch.Tensor | None) -> torch.Tensor | None:
        """[B_spec, K+1] verify ids, or None without speculation -> the verify rows' logits [B_spec * (K+1), V].

        The forward's logits come for the plain rows that sample, then for every verify row; its hidden states for
        all rows (`output`)."""
        engine, rows, speculating = self.engine, self.rows, self.speculating
        k, device = engine.num_draft_tokens, engine.device
        meta = None if speculating else engine._decode_run_meta(rows)
        if meta is None:
            meta = build_page_metadata(rows.page_lists + [r.page_table.pages for r in speculating],
                                       rows.q_lens + [k + 1] * len(speculating),
                                       rows.kv_lens + [r.num_computed + k + 1 for r in speculating],
                                       engine.config.page_size, device)
        logits_rows = None  # decodes only, or verify rows only: every row's logits
        if not rows.num_tokens:
            ids = verify_ids.flatten()
        else:
            ids = torch.tensor(rows.input_ids, dtype=torch.long, device=device)
            if speculating or len(rows.sampling) < rows.num_tokens:
                logits_rows = torch.tensor(rows.sample_rows, dtype=torch.long, device=device)
            if speculating:
                ids = torch.cat((ids, verify_ids.flatten()))
                logits_rows = torch.cat((logits_rows, torch.arange(rows.num_tokens, ids.shape[0], device=device)))
        self.input_ids, self.meta = ids, meta
        self.output = engine.runner.run(ids, meta, logits_rows,
                                        aux_layers=engine.drafter.target_aux_layers if engine.drafter else ())
        return self.output.logits[len(rows.sample_rows):] if speculating else None

    def target_rows(self, sampled: torch.Tensor | None, emitted: torch.Tensor | None,
                    num_emitted: torch.Tensor | None) -> TargetRows:
        """The forward's rows for the drafter, from the plain rows' sampled tokens [S] and the verify's emitted
        tokens [B_spec, K+1] and counts [B_spec], all on the device: each verify's last settled row comes from its
        count there."""
        rows, device = self.rows, self.engine.device
        last_rows, next_ids = [], []
        if rows.scheduled:
            last_rows.append(torch.tensor([first - 1 for first in rows.first_rows[1:]], device=device))
            next_ids.append(self._plain_next_ids(sampled))
        if self.speculating:
            width = self.engine.num_draft_tokens + 1
            first = rows.num_tokens
            last_rows.append(torch.arange(first - 1, first - 1 + width * len(self.speculating), width,
                                          device=device) + num_emitted)
            next_ids.append(emitted.clamp_min(0).flatten())  # row j reads emitted token j; past them, any
        return TargetRows([r for r, _ in rows.scheduled] + self.speculating, self.input_ids, _cat(next_ids),
                          _cat(last_rows), self.meta, self.output)

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
        next_ids = torch.tensor(following, dtype=torch.long, device=self.engine.device)
        if sampled is not None:
            next_ids[torch.tensor(rows.sample_rows, device=self.engine.device)] = sampled
        return next_ids


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> Sequence[SamplingParams]:
    """Sampling parameters for each of `count` prompts: one set for all (the defaults when None), or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * count
    return params
