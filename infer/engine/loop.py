"""The engine's loop: requests in, one packed target forward a step (speculating where it can), tokens out.

`Engine` composes a scheduler (`infer.engine.scheduler`), a runner (`infer.model_runner`), a drafter when one is
attached (`infer.speculative`, one call a step: `Drafter.propose`) and an output processor
(`infer.engine.output`); `step` reads top to bottom. Without a drafter, `EngineConfig.overlap` launches each
step before the host reads the one before it (`infer.engine.overlap`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from infer.cuda_graphs import GraphSettings
from infer.engine.forward import PlainRows, TargetForward, decode_run_step
from infer.engine.output import OutputProcessor
from infer.engine.overlap import LaunchedStep, follow_on
from infer.engine.request import Request, per_prompt
from infer.engine.scheduler import Scheduler
from infer.kv_cache import PagePool, PageTable, pages_needed
from infer.loader import default_eos_ids, load_model, load_tokenizer
from infer.model_runner import ModelRunner
from infer.models.mtp_head import DRAFTER_KINDS, load_head
from infer.sampler import SamplingTensors, make_generator, sample
from infer.sampling_params import SamplingParams
from infer.speculative import DRAFTERS, Drafter, SpecStats, read_step_tokens, speculative_decode
import infer.block_drafter  # noqa: F401,E402 - registers the block head's drafter in DRAFTERS


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
    # "on": decode, verify and the drafter's uniform forwards replay CUDA graphs (off until the GPU check has passed
    # on a device); "padded": the same padded static-buffer path run eagerly (CPU tests); "off" (`infer.cuda_graphs`)
    cuda_graphs: str = "off"
    # plain decode steps (no drafter) launch the next step from the device's sampled tokens before the host reads
    # them (`infer.engine.overlap`); the same tokens either way, off by default until the GPU check has timed it
    overlap: bool = False
    # a block head's drafts at T > 0 (`infer.block_drafter.BLOCK_PROPOSALS`): "argmax" (verified with a one-hot q)
    # or "sample" (each drawn from its own row's distribution)
    block_proposals: str = "argmax"


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
        # uniform forwards of up to a page of rows a request (K+1 verify rows for any K set later) replay graphs
        self.graph_settings = GraphSettings(cfg.cuda_graphs, cfg.max_num_seqs, cfg.page_size, self.max_model_len)
        self.runner = ModelRunner(model, num_pages, cfg.page_size, cfg.backend, cfg.decode_run_steps,
                                  cfg.cuda_graphs, cfg.max_num_seqs, self.graph_settings.max_q_len, self.max_model_len)
        self.scheduler = Scheduler(self.pool, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
                                   on_preempt=self._forget)
        self.output = OutputProcessor(tokenizer, self.max_model_len, on_finish=self._forget)
        self._next_id = 0
        self.num_steps = 0
        self.drafter: Drafter | None = None
        self.num_draft_tokens = cfg.num_draft_tokens
        # batch size -> K for a step of that many requests (0: plain decoding), capped at num_draft_tokens; None:
        # always num_draft_tokens. A server sets it from the head's recommended K per batch size.
        self.draft_k_for_batch: Callable[[int], int] | None = None
        self.spec_stats: SpecStats | None = None
        self._pending: LaunchedStep | None = None  # with overlap: the step launched whose tokens are still unread

    @property
    def waiting(self) -> deque[Request]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Request]:
        return self.scheduler.running

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
        block = getattr(model.config, "block_size", 0) if architecture == "block" else 0
        if block and self.num_draft_tokens >= block:
            raise ValueError(f"num_draft_tokens={self.num_draft_tokens}: this block head (block_size {block}) drafts "
                             f"1..{block - 1} tokens a step")
        devices = {p.device for p in model.parameters()}
        if devices != {self.runner.device}:
            raise ValueError(f"the drafter's weights are on {', '.join(sorted(map(str, devices)))} and the target's on "
                             f"{self.runner.device}: move the drafter to the target's device first")
        options = {"proposals": self.config.block_proposals} if kind == "block" else {}
        self.drafter = DRAFTERS[kind](model, self.pool.num_pages, self.config.page_size, self.config.backend,
                                      self.graph_settings, **options)
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
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer: pass token ids instead of text")
            prompt_text, prompt_ids = prompt, self.tokenizer.encode(prompt, verbose=False)
        else:
            prompt_text, prompt_ids = None, [int(t) for t in prompt]
        self.check_request(prompt_ids, params)
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
        self.scheduler.add(request)
        return request

    def check_request(self, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise ValueError naming what the engine cannot serve in a request; reads only the configuration, so a
        server's handlers call it before queueing."""
        params.validate(self.model.config.vocab_size)
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

    def abort(self, request: Request) -> None:
        """Stop a request now, wherever it is (waiting or running): its pages and drafter state go at once, its
        finish_reason becomes "abort". Between steps only; a finished request is left as it is."""
        if request.finished:
            return
        self.scheduler.drop(request)
        self.runner.decode_runs.reset()
        self._forget(request)
        request.finish_reason = "abort"
        request.finish_time = time.perf_counter()

    def requeue_running(self) -> list[Request]:
        """Preempt every running request (pages freed, recomputed from the first token when readmitted): a step
        that raised left their state unknown. Returns them, in running order, now first in the waiting queue."""
        self.scheduler.remove_finished()  # a request may have finished in the step before it raised
        running = list(self.running)
        for request in reversed(running):
            self.scheduler.requeue(request)
        self.runner.decode_runs.reset()
        self._pending = None  # its requests recompute from their first token; the unread tokens come again
        return running

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- one step ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Run one batch; returns the requests that finished in it.

        With a drafter attached, the decodes that can speculate verify K drafts in the same forward as the others'
        prefill chunks and plain decodes (verify rows packed after them); the drafter is then handed every row of
        that forward, before the host reads what was sampled or accepted.
        """
        if self.config.overlap and self.drafter is None:
            return self._overlapped_step()
        scheduled = self._schedule()
        if not scheduled:
            return []
        drafter, k = self.drafter, self._step_k(len(scheduled))
        speculating = self.scheduler.speculating(scheduled, k) if drafter and k else []
        chosen = {r.request_id for r in speculating}
        rows = PlainRows([(r, q) for r, q in scheduled if r.request_id not in chosen])
        if self.spec_stats is not None:
            self.spec_stats.plain_decodes += rows.num_decodes

        run_step = None if drafter else decode_run_step(self.runner.decode_runs, rows, self.pool, self.max_model_len)
        forward = TargetForward(self.runner, self.config.page_size, rows, speculating, k,
                                drafter.target_aux_layers if drafter else (), run_step)
        start, drafter_s = time.perf_counter(), drafter.seconds if drafter else 0.0
        emitted = num_emitted = None
        if speculating:
            sampling = SamplingTensors.from_params([r.params for r in speculating], self.device)
            emitted, num_emitted = speculative_decode(forward, drafter, speculating, k, sampling,
                                                      [r.generator for r in speculating])
        else:
            forward(None)
        sampled = self._sample_plain(rows, forward).sampled
        if drafter is not None:
            drafter.propose(forward.target_rows(sampled, emitted, num_emitted))
        # the host reads the step's tokens only now, in one copy: the drafter is launched
        sampled_ids, emitted_ids = read_step_tokens(sampled, emitted)
        finished = [r for (r, _), token in zip(rows.sampling, sampled_ids) if self.output.append(r, token)]
        if speculating:
            self._record_spec_time(speculating, time.perf_counter() - start, drafter.seconds - drafter_s)
            self._settle_speculation(speculating, emitted_ids, finished)
        if finished:
            self.scheduler.remove_finished()
        return finished

    def _schedule(self) -> list[tuple[Request, int]]:
        """This step's (request, new tokens) pairs (`Scheduler.schedule`), counted as a step when there are any."""
        scheduled = self.scheduler.schedule()
        if not scheduled and self.waiting:
            raise RuntimeError("no request fits in the KV cache; raise num_pages or lower max_num_seqs")
        self.num_steps += bool(scheduled)
        return scheduled

    def _sample_plain(self, rows: PlainRows, forward: TargetForward) -> LaunchedStep:
        """Sample the plain rows that end a request's known tokens, on the device (nothing read back)."""
        requests = [r for r, _ in rows.sampling]
        if not requests:
            return LaunchedStep([], None, None)
        tensors = SamplingTensors.from_params([r.params for r in requests], self.device)
        sampled = sample(forward.output.logits[: len(requests)], tensors, [r.generator for r in requests])
        return LaunchedStep(requests, sampled, tensors)

    def _overlapped_step(self) -> list[Request]:
        """A step without a drafter, overlapped (`infer.engine.overlap`): the step launched last time (or one
        scheduled now), then the step after it launched from its device-side tokens where it can be, and only then
        the host's read of the first one's tokens. Returns the requests that finished in the read."""
        launched, self._pending = self._pending, None
        if launched is None or not launched.live:
            scheduled = self._schedule()
            if not scheduled:
                return []
            rows = PlainRows(scheduled)
            meta = decode_run_step(self.runner.decode_runs, rows, self.pool, self.max_model_len)
            forward = TargetForward(self.runner, self.config.page_size, rows, [], 0, (), meta)
            forward(None)
            launched = self._sample_plain(rows, forward)
        launched.copy_to_host()
        self._pending = follow_on(self, launched)
        sampled_ids = launched.tokens()
        # a request that ended at the step before (or was aborted) had its row of this one computed: discarded
        finished = [r for r, token in zip(launched.requests, sampled_ids)
                    if not r.finished and self.output.append(r, token)]
        if finished:
            self.scheduler.remove_finished()
        return finished

    def _step_k(self, batch_size: int) -> int:
        """K for a step of `batch_size` requests (0: decode it plainly)."""
        if self.draft_k_for_batch is None:
            return self.num_draft_tokens
        return max(0, min(self.draft_k_for_batch(batch_size), self.num_draft_tokens))

    def _settle_speculation(self, requests: list[Request], emitted: list[list[int]], finished: list[Request]) -> None:
        """Append each request's emitted tokens and record acceptance; the rejected drafts' pages go back."""
        for request, tokens in zip(requests, emitted):
            request.spec_stats.record(len(tokens) - 1)
            self.spec_stats.record(len(tokens) - 1)
            if self.output.append_verified(request, tokens):
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

    def _forget(self, request: Request) -> None:
        """A request stopped or lost its pages: the drafter's state of it goes too."""
        if self.drafter is not None:
            self.drafter.forget(request.request_id)

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
