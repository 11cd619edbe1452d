"""Speculative decoding: a drafter proposes K tokens, the target verifies them in one forward.

Terms (per request):
  settled   the positions whose KV the target holds (`num_computed`); one more token, the last emitted, is pending
  carry     the drafter's logits (and, for MTP, its hidden state) at its last cached position: they propose the
            first draft of the next step without another forward
  catch-up  after every target forward the drafter runs over the positions the target has just settled, so it
            ends each step in lockstep with the target (a one-layer head writes every position's K/V but computes
            its output at the carry's position alone: `PageMetadata.output_rows`)
  emitted   the accepted drafts, then one token from the target (a correction, or a bonus after K acceptances)

A drafter holds its own KV tensors, indexed by the *same* page tables as the target's (one allocator, one
scheduler), and its per-request state (`DraftState`) behind its methods. The drafters differ in what a
position eats:
  - `DraftModel` (a small LM): position i reads token t_i, so it runs one token ahead of the target;
  - `MTPDrafter` (an MTP head): position i reads (t_{i+1}, h_i), h_i the target's hidden state, so it catches up
    over exactly the positions the target computed; its own h' feeds its later drafts;
  - `Eagle3Drafter` (an EAGLE-3 head): the same, h_i being the head's fusion of three of the target's layers, which
    every target forward (prefill, decode, verify) returns as aux hidden states (`target_aux_layers`).

`speculative_decode` is gpt-fast's `speculative_decode`, batched: a function of the target's forward, the drafter
and the decode requests that speculate this step, returning the emitted tokens. The target forward is the engine's:
it packs the verify rows beside other requests' prefill chunks and plain decodes, so one forward serves a mixed
batch. It never changes a request; the engine appends the tokens, stops requests, shrinks page tables, records
statistics and calls `Drafter.catch_up`. Draft ids stay on the device from the first draft to the verification;
the host reads once per step, the emitted tokens.

Two catch-up schedules for an MTP head (`EngineConfig.draft_catch_up`), the same tokens either way: "accepted" (the
default, and a draft LM's only schedule) runs the head once the host has read the accepted lengths; "verified" (the
seed's) runs it right after verification, before that read, reading the target's own token at each verified position
(the accepted draft, then the correction) on the device. When the verify rows had the target's forward to themselves,
both run the head over all K+1 verify rows on the verify forward's own page metadata, its output at the carry's row
alone: positions past the accepted prefix are redundant work, rewritten later, and a step builds one page metadata
instead of two. Beside other requests' rows (a mixed batch) a head catches up over the accepted spans (accepted, once
the engine has appended the tokens) or on metadata of its own (verified).

A catch-up's carries stay batched (`Carry`): while the next step drafts for the same requests in the same order,
the first draft reads them as they are.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from infer.kv_cache import DecodeSteps, PageMetadata, PageTable, build_page_metadata
from infer.model_runner import ModelRunner
from infer.models.common import ModelOutput
from infer.rejection_sampler import greedy_accept, greedy_verify, rejection_sample
from infer.sampler import SamplingTensors, sample, target_probs


class Sequence(Protocol):
    """What speculation reads of a request (`infer.engine.Request` is one)."""

    request_id: int
    token_ids: list[int]  # prompt then output
    num_computed: int  # settled positions
    page_table: PageTable


@dataclass
class SpecStats:
    """Acceptance and time, per request and for the engine as a whole."""

    num_draft_tokens: int
    verify_steps: int = 0  # target forwards that verified drafts
    plain_decodes: int = 0  # decode steps that did not speculate (no room, or the drafter lagging)
    emitted: int = 0  # tokens those forwards produced (accepted drafts + one from the target each)
    accepted_length_histogram: list[int] = field(default_factory=list)  # steps that accepted exactly n drafts
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0

    def __post_init__(self) -> None:
        self.accepted_length_histogram = self.accepted_length_histogram or [0] * (self.num_draft_tokens + 1)

    def record(self, num_accepted: int) -> None:
        self.verify_steps += 1
        self.emitted += num_accepted + 1
        self.accepted_length_histogram[num_accepted] += 1

    @property
    def accepted_per_position(self) -> list[int]:
        """Per draft position j: the steps that accepted draft j (those that accepted more than j drafts)."""
        counts = list(itertools.accumulate(reversed(self.accepted_length_histogram[1:])))  # more than K-1, K-2, ...
        return counts[::-1]

    @property
    def tau(self) -> float:
        """Tokens per target step while speculating (1 means drafts never helped)."""
        return self.emitted / self.verify_steps if self.verify_steps else 0.0

    def conditional_acceptance(self) -> tuple[list[float], list[float]]:
        """Per draft position j: (accepted at j / steps that reached j, its binomial standard error); 0 where no
        step reached j. Unlike `acceptance_per_position` (the unconditional share of steps), these do not
        compound: tau = 1 + sum_j prod_{i<=j} a_i."""
        reached = self.reached()
        rates = [a / n if n else 0.0 for a, n in zip(self.accepted_per_position, reached)]
        errors = [math.sqrt(r * (1 - r) / n) if n else 0.0 for r, n in zip(rates, reached)]
        return rates, errors

    def reached(self) -> list[int]:
        """Per draft position j: the steps that reached it (drafts 1..j-1 accepted)."""
        return [self.verify_steps, *self.accepted_per_position[:-1]]

    def to_dict(self) -> dict:
        steps = max(self.verify_steps, 1)
        rates, errors = self.conditional_acceptance()
        return {
            "num_draft_tokens": self.num_draft_tokens,
            "verify_steps": self.verify_steps,
            "speculated_share": round(self.verify_steps / max(self.verify_steps + self.plain_decodes, 1), 4),
            "tau": round(self.tau, 4),
            "acceptance_per_position": [round(a / steps, 4) for a in self.accepted_per_position],  # unconditional
            "conditional_acceptance": [round(r, 4) for r in rates],
            "conditional_acceptance_se": [round(e, 4) for e in errors],
            "reached": self.reached(),
            "accepted_length_histogram": list(self.accepted_length_histogram),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
        }


@dataclass
class Carry:
    """The carries of one catch-up's batch, kept batched: row b is the b-th sequence's. While the next step drafts
    for the same sequences in the same order (a speculating batch that stays the same), `propose` reads these
    tensors as they are, instead of splitting them per request and stacking them again."""

    logits: Tensor  # [B, V]
    hidden: Tensor | None  # [B, H] an MTP head's own state, None for a draft LM


@dataclass
class DraftState:
    """A drafter's view of one request."""

    computed: int  # positions its cache holds
    carry: Carry  # the drafter's output at the last of them: row `row` of its batch's
    row: int

    @property
    def logits(self) -> Tensor:
        """[V]"""
        return self.carry.logits[self.row]

    @property
    def hidden(self) -> Tensor:
        """[H] (an MTP head's)"""
        return self.carry.hidden[self.row]


class Drafter:
    """What both drafters share: a ModelRunner over the shared pages, and the catch-up bookkeeping."""

    kind: str  # what Engine.attach_drafter calls it
    token_shift = 0  # position i reads token t_{i + token_shift}
    needs_hidden_states = False
    # a one-layer head: its catch-up needs every position's K/V but only the carry's output (PageMetadata.output_rows)
    one_layer = False
    target_aux_layers: tuple[int, ...] = ()  # intermediate layers the target's forwards must return for it

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str) -> None:
        self.runner = ModelRunner(model, num_pages, page_size, backend)
        self.page_size = page_size
        self.device = self.runner.device
        self._states: dict[int, DraftState] = {}

    # --- per-request state ------------------------------------------------------------------------
    def num_cached(self, request_id: int) -> int:
        """Positions of this request in the drafter's cache (its page table must cover them)."""
        state = self._states.get(request_id)
        return state.computed if state else 0

    def carried_logits(self, request_id: int) -> Tensor | None:
        state = self._states.get(request_id)
        return state.logits if state else None

    def catch_up_end(self, seq: Sequence) -> int:
        """Positions the drafter should hold once the target has settled `seq.num_computed` of them."""
        return min(seq.num_computed + 1 - self.token_shift, len(seq.token_ids) - self.token_shift)

    def ready(self, seq: Sequence) -> bool:
        """Whether the drafter can propose for `seq` now: it has seen it and is in lockstep with the target."""
        state = self._states.get(seq.request_id)
        return state is not None and state.computed == self.catch_up_end(seq)

    def rollback(self, request_id: int, num_computed: int) -> None:
        """Forget positions past the target's settled prefix (they hold rejected drafts)."""
        state = self._states.get(request_id)
        if state is not None:
            state.computed = min(state.computed, num_computed)

    def forget(self, request_id: int) -> None:
        """The request finished or lost its pages (preemption): its drafter state goes with them."""
        self._states.pop(request_id, None)

    def target_features(self, out: ModelOutput) -> Tensor:
        """[T, H] what the drafter reads from a target forward at each of its positions (catch-up's hidden); called
        in the engine step's inference mode."""
        return out.hidden_states

    # --- forwards ---------------------------------------------------------------------------------
    def catch_up(self, seqs: list[Sequence], target_hidden: dict[int, tuple[int, Tensor]]) -> None:
        """Run the drafter over each request's unsettled positions; keep the last position's output as carry.

        target_hidden: request_id -> (first position, [n, H] the target's hidden states from that position).
        """
        spans = [(s, self.num_cached(s.request_id), self.catch_up_end(s)) for s in seqs]
        spans = [(s, start, end) for s, start, end in spans if end > start]
        if not spans:
            return
        input_ids: list[int] = []
        hidden_rows: list[Tensor] = []
        for seq, start, end in spans:
            input_ids.extend(seq.token_ids[start + self.token_shift : end + self.token_shift])
            if self.needs_hidden_states:
                first, hidden = target_hidden[seq.request_id]
                hidden_rows.append(hidden[start - first : end - first])
        q_lens = [end - start for _, start, end in spans]
        # [B] each span's last row in the packed batch, the rows scored (None when every span is one row: all rows);
        # a one-layer head computes those rows alone
        last_rows = None if max(q_lens) == 1 else torch.tensor(
            [row - 1 for row in itertools.accumulate(q_lens)], device=self.device)
        meta = build_page_metadata([s.page_table.pages for s, _, _ in spans], q_lens, [end for _, _, end in spans],
                                   self.page_size, self.device)
        if self.one_layer:
            meta.output_rows = last_rows
        hidden_in = None
        if hidden_rows:
            hidden_in = hidden_rows[0] if len(hidden_rows) == 1 else torch.cat(hidden_rows)
        out = self._run(torch.tensor(input_ids, dtype=torch.long, device=self.device), meta, last_rows, hidden_in)
        carry = Carry(out.logits, self._scored_hidden(out, last_rows) if self.needs_hidden_states else None)
        for row, (seq, _, end) in enumerate(spans):
            self._states[seq.request_id] = DraftState(end, carry, row)

    def propose(
        self, seqs: list[Sequence], k: int, sampling: SamplingTensors, generators: list[torch.Generator]
    ) -> tuple[Tensor, Tensor | None]:
        """Draft k tokens per request: ([B, k] ids on the device, [B, k, V] draft probabilities or None if greedy)."""
        states = [self._states[s.request_id] for s in seqs]
        carry = states[0].carry
        if carry.logits.shape[0] == len(states) and all(s.carry is carry and s.row == b for b, s in enumerate(states)):
            logits, hidden = carry.logits, carry.hidden  # [B, V], [B, H] | None: the last catch-up's batch
        else:
            logits = torch.stack([s.logits for s in states])
            hidden = torch.stack([s.hidden for s in states]) if self.needs_hidden_states else None
        # Draft forward j writes position computed + j of every request: one metadata build serves the k-1 forwards.
        steps = DecodeSteps([s.page_table.pages for s in seqs], [s.computed for s in states], k - 1, self.page_size,
                            self.device) if k > 1 else None
        tokens, probs = [], []
        for j in range(k):
            if not sampling.all_greedy:
                probs.append(target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p))
            tokens.append(sample(logits, sampling, generators))
            if j == k - 1:
                break
            # It reads the draft just made (and, for MTP, the head's own last hidden state); these cache rows past
            # the settled prefix are rewritten by the next catch-up.
            out = self._run(tokens[-1], steps.step(j), None, hidden)
            logits, hidden = out.logits, (out.hidden_states if self.needs_hidden_states else None)
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _scored_hidden(self, out: ModelOutput, rows: Tensor | None) -> Tensor:
        """[B, H] a head's hidden states at the rows it scored: the rows its backend computed alone, or those of
        every row's (FlashInfer computes every row)."""
        return out.hidden_states if rows is None or self.runner.attn.output_rows is not None else out.hidden_states[rows]

    def _run(self, input_ids: Tensor, meta: PageMetadata, logits_indices: Tensor | None,
             hidden: Tensor | None) -> ModelOutput:
        extra = {"hidden_states": hidden} if self.needs_hidden_states else {}
        return self.runner.run(input_ids, meta, logits_indices, **extra)


class DraftModel(Drafter):
    """A smaller causal LM sharing the target's tokenizer."""

    kind = "draft"


class MTPDrafter(Drafter):
    """An MTP head fed with the target's hidden states."""

    kind = "mtp"
    token_shift = 1
    needs_hidden_states = True
    one_layer = True

    def target_features(self, out: ModelOutput) -> Tensor:
        return self.runner.model.features(out.hidden_states)  # h_i, through the target's norm for post_norm heads

    def catch_up_verified(self, seqs: list[Sequence], own_tokens: Tensor, num_emitted: Tensor, target_hidden: Tensor,
                          verify_meta: PageMetadata | None = None) -> None:
        """The "verified" schedule: run over all K+1 verified positions before the host knows how many were
        accepted. Position num_computed + i reads the target's own token there (own_tokens[:, i]: the accepted
        draft, or the correction; past those, any token: redundant rows) and the target's hidden state; the head's
        output is computed at the last emitted token's row alone (found on the device), the carry.

        own_tokens [B, K+1] (`speculative_decode`'s); num_emitted [B]; target_hidden [B, K+1, H]; verify_meta: the
        verify forward's page metadata when it held these rows alone (the same positions: no second build), else None.
        """
        width = own_tokens.shape[1]  # K+1
        last_rows = torch.arange(len(seqs), device=self.device) * width + num_emitted - 1  # [B] the carry's rows
        carry = self._run_verify_rows(seqs, own_tokens, last_rows, target_hidden, verify_meta)
        self._hold(seqs, carry, num_emitted.tolist())  # the step's host read, after the head's forward was launched

    def catch_up_accepted(self, seqs: list[Sequence], own_tokens: Tensor, counts: list[int], target_hidden: Tensor,
                          verify_meta: PageMetadata) -> None:
        """The default schedule's catch-up when the verify rows had the target's forward to themselves: the host has
        read how many tokens each request emitted, and the head runs over all K+1 verify rows on the verify forward's
        own metadata (no second build, no per-request slices of the target's hidden states), its output at each
        request's last emitted row alone. Rows past the emitted ones read whatever own_tokens holds there: redundant
        work, rewritten by the next step's drafts and catch-up before any query reads them (as in the verified
        schedule).

        own_tokens [B, K+1]: the emitted tokens first in each row; counts: per request how many (1..K+1);
        target_hidden [B, K+1, H]."""
        width = target_hidden.shape[1]  # K+1
        last_rows = torch.tensor([b * width + n - 1 for b, n in enumerate(counts)], device=self.device)
        carry = self._run_verify_rows(seqs, own_tokens, last_rows, target_hidden, verify_meta)
        self._hold(seqs, carry, counts)

    def _run_verify_rows(self, seqs: list[Sequence], own_tokens: Tensor, last_rows: Tensor, target_hidden: Tensor,
                         verify_meta: PageMetadata | None) -> Carry:
        """The head over every verify row (own_tokens [B, K+1] or flat, target_hidden [B, K+1, H]), its output at
        last_rows [B] alone: the carries."""
        batch, width = target_hidden.shape[:2]
        if verify_meta is None:
            verify_meta = build_page_metadata([s.page_table.pages for s in seqs], [width] * batch,
                                              [s.num_computed + width for s in seqs], self.page_size, self.device)
        meta = copy.copy(verify_meta)  # dataclasses.replace would run __init__ again: 4x the time at batch 8
        meta.output_rows = last_rows
        out = self._run(own_tokens.flatten(), meta, last_rows, target_hidden.flatten(0, 1))
        return Carry(out.logits, self._scored_hidden(out, last_rows))

    def _hold(self, seqs: list[Sequence], carry: Carry, counts: list[int]) -> None:
        """After a catch-up over verify rows: each request's cache holds its settled prefix and its emitted tokens'
        positions (num_computed is still the verify's first position)."""
        for row, (seq, count) in enumerate(zip(seqs, counts)):
            self._states[seq.request_id] = DraftState(seq.num_computed + count, carry, row)


CATCH_UP_SCHEDULES = ("accepted", "verified")  # EngineConfig.draft_catch_up


class Eagle3Drafter(MTPDrafter):
    """An EAGLE-3 head: step 0 reads its fc-fusion of the target's low, mid and high layers."""

    kind = "eagle3"

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str) -> None:
        super().__init__(model, num_pages, page_size, backend)
        self.target_aux_layers = tuple(model.target_aux_layers)

    def target_features(self, out: ModelOutput) -> Tensor:
        aux = torch.stack([out.aux_hidden_states[layer] for layer in self.target_aux_layers], dim=1)  # [T, 3, H]
        return self.runner.model.features(out.hidden_states, aux.to(self.runner.dtype))


DRAFTERS: dict[str, type[Drafter]] = {cls.kind: cls for cls in (DraftModel, MTPDrafter, Eagle3Drafter)}


@dataclass
class SpecOutput:
    emitted: list[list[int]]  # per request: the accepted drafts, then the target's token (1..K+1 tokens)
    hidden_states: Tensor  # [B, K+1, H] the verify rows' hidden states, for the drafter's catch-up
    draft_time_s: float
    verify_time_s: float
    caught_up: bool  # the drafter already holds the emitted positions (the "verified" schedule)


# The target forward over the verify rows: [B, K+1] token ids -> (logits [B*(K+1), V] and hidden [B*(K+1), H],
# the forward's page metadata when it held the verify rows alone, else None).
TargetForward = Callable[[Tensor], tuple[ModelOutput, PageMetadata | None]]


def speculative_decode(
    target_forward: TargetForward, drafter: Drafter, seqs: list[Sequence], k: int, sampling: SamplingTensors,
    generators: list[torch.Generator], schedule: str = "accepted",
) -> SpecOutput:
    """One draft-verify-accept round for decode requests whose page tables already hold K+1 more positions.

    schedule: the drafter's catch-up, "accepted" (after the host has read the outcome: here for a head whose verify rows
    had the target's forward alone, else by the engine once it has settled) or "verified" (here, before the host
    reads the outcome; an MTPDrafter's: the engine checks when the drafter is attached)."""
    batch = len(seqs)
    start = time.perf_counter()
    draft_ids, draft_probs = drafter.propose(seqs, k, sampling, generators)  # [B, K], [B, K, V] | None
    draft_time = time.perf_counter() - start

    # Verify: the pending token and the K drafts, at positions num_computed .. num_computed + K.
    start = time.perf_counter()
    pending = torch.tensor([s.token_ids[-1] for s in seqs], device=draft_ids.device)[:, None]  # [B, 1]
    verify_ids = torch.cat((pending, draft_ids), dim=1)  # [B, K+1]
    out, verify_meta = target_forward(verify_ids)
    target_logits = out.logits.view(batch, k + 1, -1)  # [B, K+1, V]
    hidden = out.hidden_states.view(batch, k + 1, -1)  # [B, K+1, H]
    verified = schedule == "verified"
    emitted = None
    target_argmax = target_logits.argmax(-1) if draft_probs is None else None  # [B, K+1]
    if draft_probs is None and not verified:  # only the host reads the outcome: cut it there
        rows = greedy_accept(draft_ids, target_argmax)
    elif draft_probs is None:
        emitted, num_emitted = greedy_verify(draft_ids, target_argmax)
    else:
        repeat = lambda t: t.repeat_interleave(k + 1)  # noqa: E731 - per request -> per verified position
        p = target_probs(target_logits.flatten(0, 1), repeat(sampling.temperature), repeat(sampling.top_k),
                         repeat(sampling.top_p)).view(batch, k + 1, -1)  # [B, K+1, V]
        emitted, num_emitted = rejection_sample(draft_ids, draft_probs, p, generators)
    verify_time = time.perf_counter() - start
    start = time.perf_counter()
    # A head catches up here: before the host reads the outcome (verified), or on the verify forward's metadata once
    # it has, when the verify rows had that forward to themselves (accepted); otherwise the engine runs the catch-up
    # over the accepted spans once it has settled them.
    on_verify_rows = not verified and verify_meta is not None and isinstance(drafter, MTPDrafter)
    if verified or on_verify_rows:  # the target's own token at each verified position, what the head reads there:
        # the accepted drafts and the correction first (greedy: the target's first argmaxes), past them any token
        own_tokens = target_argmax if draft_probs is None else torch.where(emitted >= 0, emitted, verify_ids)
    if verified:
        drafter.catch_up_verified(seqs, own_tokens, num_emitted, hidden, verify_meta)
    if emitted is not None:
        rows = [row[:n] for row, n in zip(emitted.tolist(), num_emitted.tolist())]
    if on_verify_rows:
        drafter.catch_up_accepted(seqs, own_tokens, [len(row) for row in rows], hidden, verify_meta)
    return SpecOutput(rows, hidden, draft_time + time.perf_counter() - start, verify_time,
                      caught_up=verified or on_verify_rows)
