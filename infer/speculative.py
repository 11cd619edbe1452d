"""Speculative decoding: a drafter proposes K tokens, the target verifies them in one forward.

Two drafters share one protocol. A drafter holds its own KV tensors, indexed by the *same* page tables
as the target's (one allocator, one scheduler), and keeps per request:
  - `draft_computed`: how many positions its cache holds;
  - `draft_carry`:    its logits (and, for MTP, its hidden state) at the last of them, which propose the
                      first draft token of the next step without another forward.
After every target forward the drafter *catches up* over the positions the target has just settled, so
it always ends a step in lockstep with the target. The two drafters differ in what a position eats:
  - `DraftModel` (a small LM): position i reads token t_i, so it runs one token ahead of the target
    (it also reads the token the target has just emitted).
  - `MTPDrafter` (an MTP head): position i reads (t_{i+1}, h_i) with h_i the target's hidden state, so
    it catches up over exactly the positions the target computed; its own h' feeds later drafts.

A speculative step for a decode-only batch (gpt-fast's `speculative_decode`, batched):
  1. draft: d_1 from the carried logits; d_2..d_K from K-1 one-token drafter forwards;
  2. verify: one target forward over [t_last, d_1..d_K] (K+1 positions per request);
  3. accept: greedy equality or rejection sampling over the full distributions (`rejection_sampler`);
  4. roll back: the target keeps the accepted prefix, the page table shrinks; the drafter catches up
     over the accepted span (its drafting writes past that are simply overwritten later).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from infer.kv_cache import build_page_metadata
from infer.model_runner import ModelRunner
from infer.models.common import ModelOutput
from infer.rejection_sampler import greedy_verify, rejection_sample
from infer.sampler import SamplingTensors, sample, target_probs

if TYPE_CHECKING:
    from infer.engine import Engine, Request


@dataclass
class SpecStats:
    """Acceptance and time, per request and for the engine as a whole."""

    num_draft_tokens: int
    verify_steps: int = 0  # target forwards that verified drafts
    emitted: int = 0  # tokens those forwards produced (accepted drafts + one from the target each)
    accepted_per_position: list[int] = field(default_factory=list)  # drafts accepted at position j
    accepted_length_histogram: list[int] = field(default_factory=list)  # steps that accepted exactly n drafts
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def __post_init__(self) -> None:
        k = self.num_draft_tokens
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.accepted_length_histogram = self.accepted_length_histogram or [0] * (k + 1)

    def record(self, num_accepted: int) -> None:
        self.verify_steps += 1
        self.emitted += num_accepted + 1
        self.accepted_length_histogram[num_accepted] += 1
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1

    @property
    def tau(self) -> float:
        """Tokens per target step while speculating (1 means drafts never helped)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict:
        steps = max(self.verify_steps, 1)
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "verify_steps": self.verify_steps,
            "tau": round(self.tau, 4),
            "acceptance_per_position": [round(a / steps, 4) for a in self.accepted_per_position],
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
        }


class Drafter:
    """What both drafters share: a ModelRunner over the shared pages, and the catch-up bookkeeping."""

    token_shift = 0  # position i reads token t_{i + token_shift}
    needs_hidden_states = False

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str) -> None:
        self.runner = ModelRunner(model, num_pages, page_size, backend)
        self.page_size = page_size
        self.device = self.runner.device

    def catch_up_end(self, request: "Request") -> int:
        """Positions the drafter should hold once the target has settled `request.num_computed` of them."""
        return min(request.num_computed + 1 - self.token_shift, request.num_tokens - self.token_shift)

    def catch_up(self, requests: list["Request"], target_hidden: dict[int, tuple[int, torch.Tensor]]) -> None:
        """Run the drafter over each request's unsettled positions; keep the last position's output as carry.

        target_hidden: request_id -> (first position, [n, H] hidden states) from this step's target forward.
        """
        spans = [(r, r.draft_computed, self.catch_up_end(r)) for r in requests]
        spans = [(r, start, end) for r, start, end in spans if end > start]
        if not spans:
            return
        input_ids: list[int] = []
        hidden_rows: list[torch.Tensor] = []
        for request, start, end in spans:
            input_ids.extend(request.token_ids[start + self.token_shift : end + self.token_shift])
            if self.needs_hidden_states:
                first, hidden = target_hidden[request.request_id]
                hidden_rows.append(hidden[start - first : end - first])
        q_lens = [end - start for _, start, end in spans]
        last_rows = torch.tensor(q_lens).cumsum(0) - 1
        out = self._forward(
            input_ids, [r.page_table.pages for r, _, _ in spans], q_lens, [end for _, _, end in spans],
            torch.cat(hidden_rows) if hidden_rows else None, last_rows.to(self.device),
        )
        for i, (request, _, end) in enumerate(spans):
            request.draft_computed = end
            hidden = out.hidden_states[int(last_rows[i])] if self.needs_hidden_states else None
            request.draft_carry = (out.logits[i], hidden)

    def _forward(
        self, input_ids: list[int], page_lists: list[list[int]], q_lens: list[int], kv_lens: list[int],
        hidden: torch.Tensor | None, logits_indices: torch.Tensor | None = None,
    ) -> ModelOutput:
        meta = build_page_metadata(page_lists, q_lens, kv_lens, self.page_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        extra = {"hidden_states": hidden} if self.needs_hidden_states else {}
        return self.runner.run(ids, meta, logits_indices, **extra)

    def propose(
        self, requests: list["Request"], k: int, st: SamplingTensors
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens per request: ([B, k] ids, [B, k, V] draft probabilities, or None when all greedy)."""
        logits = torch.stack([r.draft_carry[0] for r in requests])  # [B, V]
        hidden = torch.stack([r.draft_carry[1] for r in requests]) if self.needs_hidden_states else None
        generators = [r.generator for r in requests]
        page_lists = [r.page_table.pages for r in requests]
        base = [r.draft_computed for r in requests]
        tokens, probs = [], []
        for j in range(k):
            if not st.all_greedy:
                probs.append(target_probs(logits, st.temperature, st.top_k, st.top_p))
            tokens.append(sample(logits, st, generators))
            if j == k - 1:
                break
            # Position base + j reads the draft just made (and, for MTP, the head's own last hidden state).
            out = self._forward(tokens[-1].tolist(), page_lists, [1] * len(requests), [b + j + 1 for b in base],
                                hidden)
            logits, hidden = out.logits, (out.hidden_states if self.needs_hidden_states else None)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)


class DraftModel(Drafter):
    """A smaller causal LM sharing the target's tokenizer."""


class MTPDrafter(Drafter):
    """An MTP head fed with the target's hidden states."""

    token_shift = 1
    needs_hidden_states = True


def speculative_step(engine: "Engine", requests: list["Request"]) -> list["Request"]:
    """One draft-verify-accept round for a decode-only batch; returns the requests that finished."""
    drafter, stats, k = engine.drafter, engine.spec_stats, engine.num_draft_tokens
    st = SamplingTensors.from_params([r.params for r in requests], engine.device)

    start = time.perf_counter()
    draft_ids, draft_probs = drafter.propose(requests, k, st)  # [B, K], [B, K, V] | None
    draft_time = time.perf_counter() - start

    # Verify: the last emitted token and the K drafts, at positions num_computed .. num_computed + K.
    start = time.perf_counter()
    first = [r.num_computed for r in requests]
    verify_ids = torch.cat((torch.tensor([r.token_ids[-1] for r in requests])[:, None], draft_ids.cpu()), dim=1)
    meta = build_page_metadata([r.page_table.pages for r in requests], [k + 1] * len(requests),
                               [n + k + 1 for n in first], engine.config.page_size, engine.device)
    out = engine.runner.run(verify_ids.flatten().to(engine.device), meta)
    target_logits = out.logits.view(len(requests), k + 1, -1)
    if draft_probs is None:
        emitted, num_emitted = greedy_verify(draft_ids, target_logits.argmax(-1))
    else:
        p = target_probs(target_logits.flatten(0, 1), st.temperature.repeat_interleave(k + 1),
                         st.top_k.repeat_interleave(k + 1), st.top_p.repeat_interleave(k + 1))
        emitted, num_emitted = rejection_sample(draft_ids, draft_probs, p.view(len(requests), k + 1, -1),
                                                [r.generator for r in requests])
    emitted_rows, counts = emitted.tolist(), num_emitted.tolist()
    verify_time = time.perf_counter() - start

    finished, survivors, target_hidden = [], [], {}
    for i, request in enumerate(requests):
        request.spec_stats.record(counts[i] - 1)
        stats.record(counts[i] - 1)
        done = False
        for token in emitted_rows[i][: counts[i]]:
            request.num_computed = request.num_tokens  # everything before the new token is now in the cache
            if engine.append_token(request, token):
                done = True
                break
        if done:
            finished.append(request)
            continue
        # Roll back: positions past the accepted prefix hold rejected drafts in both caches.
        request.draft_computed = min(request.draft_computed, request.num_computed)
        survivors.append(request)
        target_hidden[request.request_id] = (first[i], out.hidden_states[i * (k + 1) : (i + 1) * (k + 1)])

    start = time.perf_counter()
    drafter.catch_up(survivors, target_hidden)
    for request in survivors:
        request.page_table.truncate(max(request.num_computed, request.draft_computed))
    draft_time += time.perf_counter() - start

    share = 1.0 / len(requests)
    for request in requests:
        request.spec_stats.draft_time_s += draft_time * share
        request.spec_stats.verify_time_s += verify_time * share
    stats.draft_time_s += draft_time
    stats.verify_time_s += verify_time
    return finished
