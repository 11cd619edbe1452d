"""Speculative decoding: a drafter proposes K tokens, the target verifies them in one forward.

Terms (per request):
  settled   the positions whose KV the target holds (`num_computed`); one more token, the last emitted, is pending
  emitted   a verify's accepted drafts, then one token from the target (a correction, or a bonus after K acceptances)
  rows      the tokens of one target forward, packed: prefill chunks, plain decodes, and K+1 verify rows per
            speculating request (the pending token and its K drafts)
  carry     a head's logits and hidden state at the row of a request's last settled position: they propose the
            first draft of the next step without another forward

The drafter seam (vLLM's `propose`): after every target forward the engine calls `Drafter.propose(TargetRows)`
once, with every row the forward computed; a drafter catches up there, and drafts when `speculative_decode` asks
(`Drafter.draft`). A head has one schedule, whatever the batch holds: its catch-up covers every row the target
computed, all K+1 verify rows included (rows past the accepted prefix are redundant work, rewritten before any query
reads them), and the row carried forward (`TargetRows.last_rows`) is picked on the device from the accepted length,
so nothing waits for the host to read the outcome before the drafter is launched.

A drafter holds its own KV tensors, indexed by the *same* page tables as the target's (one allocator, one
scheduler), at the same positions as the target's rows:
  - `DraftModel` (a small LM): position i reads token t_i, as the target's row there: it runs the target's own
    tokens on the target's page metadata, except after a forward of verify rows alone, whose tokens its drafts
    wrote already; its first draft forward reads the pending token (and the last draft, when all were accepted);
  - `MTPDrafter` (an MTP head): position i reads (t_{i+1}, h_i), h_i the target's hidden state there: the row's
    next token (`TargetRows.next_token_ids`); its output at the carry's row alone (`PageMetadata.output_rows`);
    its own h' feeds its later drafts;
  - `Eagle3Drafter` (an EAGLE-3 head): the same, h_i being the head's fusion of three of the target's layers, which
    every target forward returns as aux hidden states (`target_aux_layers`).

`speculative_decode` is gpt-fast's `speculative_decode`, batched: a function of the target's forward, the drafter
and the decode requests that speculate this step, returning the emitted tokens on the device. The target forward is
the engine's: it packs the verify rows beside other requests' prefill chunks and plain decodes, so one forward
serves a mixed batch. It never changes a request; the engine appends the tokens, stops requests and shrinks page
tables. Draft ids stay on the device from the first draft to the verification; the host reads once per step, the
emitted tokens, after the drafter's catch-up was launched.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

from infer.cuda_graphs import GraphSettings
from infer.device_copy import device_tensor
from infer.kv_cache import DecodeSteps, PageMetadata, PageTable, build_page_metadata
from infer.model_runner import ModelRunner
from infer.models.common import ModelOutput
from infer.rejection_sampler import greedy_verify, rejection_sample
from infer.sampler import SamplingTensors, sample, target_probs


class SpeculatingRequest(Protocol):
    """What speculation reads of a request (`infer.engine.Request` is one)."""

    request_id: int
    token_ids: list[int]  # prompt then output; the last is pending
    num_computed: int  # settled positions
    page_table: PageTable


@dataclass
class SpecStats:
    """Acceptance and time, per request and for the engine as a whole."""

    num_draft_tokens: int
    verify_steps: int = 0  # target forwards that verified drafts
    plain_decodes: int = 0  # decode steps that did not speculate (no room in the budget, pages or context)
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
class TargetRows:
    """One target forward's rows, as a drafter reads them (`Drafter.propose`): B requests, T rows."""

    requests: list[SpeculatingRequest]  # every request with rows in the forward, in packed order
    input_ids: Tensor  # [T] the forward's tokens
    # [T] the token after each row's position: the next input, or the token sampled or emitted there; past a verify's
    # emitted tokens, any token (those rows are redundant)
    next_token_ids: Tensor
    last_rows: Tensor  # [B] each request's row of its last settled position (a verify's: from its accepted length)
    meta: PageMetadata  # the forward's
    output: ModelOutput  # the target's hidden states at every row (and aux layers)
    num_verifying: int = 0  # the last this many requests verified drafts (K+1 rows each)


@dataclass
class Carry:
    """The carries of one catch-up's batch, kept batched: row b is the b-th request's."""

    logits: Tensor  # [B, V]
    hidden: Tensor  # [B, H] the head's own state


class Drafter:
    """What the drafters share: a ModelRunner over the shared pages, and the draft loop."""

    kind: str  # what Engine.attach_drafter calls it
    needs_hidden_states = False
    # a one-layer head: its catch-up needs every position's K/V but only the carry's output (PageMetadata.output_rows)
    one_layer = False
    target_aux_layers: tuple[int, ...] = ()  # intermediate layers the target's forwards must return for it

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str,
                 graphs: GraphSettings | None = None) -> None:
        """graphs: how its forwards run from CUDA graphs (`infer.cuda_graphs`); None: eagerly."""
        graphs = graphs or GraphSettings()
        self.runner = ModelRunner(model, num_pages, page_size, backend, cuda_graphs=graphs.mode,
                                  max_seqs=graphs.max_seqs, max_q_len=graphs.max_q_len,
                                  max_model_len=graphs.max_model_len)
        self.page_size = page_size
        self.device = self.runner.device
        self.seconds = 0.0  # host time in propose and draft (on a GPU: launches)

    def propose(self, rows: TargetRows) -> None:
        """After a target forward: catch up over every row it computed."""
        raise NotImplementedError

    def forget(self, request_id: int) -> None:
        """The request finished or lost its pages (preemption): its drafter state goes with them."""

    def draft(self, requests: Sequence[SpeculatingRequest], k: int, sampling: SamplingTensors,
              generators: Sequence[torch.Generator]) -> tuple[Tensor, Tensor | None]:
        """Draft k tokens per request: ([B, k] ids on the device, [B, k, V] draft probabilities or None if greedy).
        Each request's page table covers its pending position + k."""
        start = time.perf_counter()
        logits, hidden, steps = self._first_logits(requests, k)  # [B, V], [B, H] | None
        tokens, probs = [], []
        for j in range(k):
            if not sampling.all_greedy:
                probs.append(target_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                          sampling.filtering))
            tokens.append(sample(logits, sampling, generators))
            if j == k - 1:
                break
            # It reads the draft just made (and, for a head, its own last hidden state); these cache rows past the
            # settled prefix are rewritten by the verify's catch-up.
            out = self._run(tokens[-1], steps.step(steps.num_steps - (k - 1) + j), None, hidden)
            logits, hidden = out.logits, (out.hidden_states if self.needs_hidden_states else None)
        self.seconds += time.perf_counter() - start
        return torch.stack(tokens, dim=1), (torch.stack(probs, dim=1) if probs else None)

    def _first_logits(self, requests: Sequence[SpeculatingRequest],
                      k: int) -> tuple[Tensor, Tensor | None, DecodeSteps | None]:
        """The logits of each request's first draft, the head's state beside them, and the draft forwards' metadata
        (its last k-1 steps serve the drafts)."""
        raise NotImplementedError

    def _run(self, input_ids: Tensor, meta: PageMetadata, logits_indices: Tensor | None,
             hidden: Tensor | None) -> ModelOutput:
        extra = {"hidden_states": hidden} if self.needs_hidden_states else {}
        return self.runner.run(input_ids, meta, logits_indices, **extra)


class DraftModel(Drafter):
    """A smaller causal LM sharing the target's tokenizer. Its cache holds what it last wrote of each request; the
    positions before the target's settled prefix ends are valid (past it, rejected drafts)."""

    kind = "draft"

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str,
                 graphs: GraphSettings | None = None) -> None:
        super().__init__(model, num_pages, page_size, backend, graphs)
        self._written: dict[int, int] = {}  # request_id -> the end of the positions its cache was written up to

    def propose(self, rows: TargetRows) -> None:
        """The target's own tokens at the target's positions, on its metadata (no logits wanted: one row's). A
        forward of verify rows alone holds nothing new to it but the last draft, which its next first draft forward
        reads when all were accepted (`_first_logits`)."""
        if rows.num_verifying == len(rows.requests):
            return
        start = time.perf_counter()
        self._run(rows.input_ids, rows.meta, rows.last_rows[:1], None)
        host = rows.meta.on_host()
        q_lens = (host.qo_indptr[1:] - host.qo_indptr[:-1]).tolist()
        for request, q_len, kv_len in zip(rows.requests, q_lens, host.kv_lens.tolist()):
            first = kv_len - q_len  # the target's settled prefix before this forward
            valid = min(self._written.get(request.request_id, 0), first)
            # rows after a gap (the last draft of a verify that accepted all, never run) wait for the next draft
            self._written[request.request_id] = kv_len if valid == first else valid
        self.seconds += time.perf_counter() - start

    def forget(self, request_id: int) -> None:
        self._written.pop(request_id, None)

    def _first_logits(self, requests: Sequence[SpeculatingRequest], k: int) -> tuple[Tensor, None, DecodeSteps | None]:
        """Its first draft forward reads the positions from its cache's valid end through the pending token: the
        pending token alone, or after a verify that accepted every draft the last draft too. Draft forward j then
        writes position num_computed + j."""
        pages = [r.page_table.pages for r in requests]
        pending_at = [r.num_computed for r in requests]
        starts = [min(self._written.get(r.request_id, 0), r.num_computed) for r in requests]
        for request in requests:
            self._written[request.request_id] = request.num_computed + k
        if starts == pending_at:  # one run of k forwards, the first over the pending tokens
            steps = DecodeSteps(pages, pending_at, k, self.page_size, self.device)
            pending = device_tensor([r.token_ids[-1] for r in requests], self.device)
            return self._run(pending, steps.step(0), None, None).logits, None, steps
        q_lens = [end + 1 - start for start, end in zip(starts, pending_at)]
        meta = build_page_metadata(pages, q_lens, [end + 1 for end in pending_at], self.page_size, self.device)
        ids = device_tensor([t for r, start in zip(requests, starts) for t in r.token_ids[start:]], self.device)
        last_rows = device_tensor(list(itertools.accumulate(q_lens)), self.device) - 1
        steps = None if k == 1 else DecodeSteps(pages, [end + 1 for end in pending_at], k - 1, self.page_size,
                                                self.device)
        return self._run(ids, meta, last_rows, None).logits, None, steps


class MTPDrafter(Drafter):
    """An MTP head fed with the target's hidden states."""

    kind = "mtp"
    needs_hidden_states = True
    one_layer = True

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str,
                 graphs: GraphSettings | None = None) -> None:
        super().__init__(model, num_pages, page_size, backend, graphs)
        self._carries: dict[int, tuple[Carry, int]] = {}  # request_id -> (its catch-up's carries, its row there)

    def target_features(self, out: ModelOutput) -> Tensor:
        """[T, H] what the head reads from a target forward at each row, h_i (through the target's norm for
        post_norm heads)."""
        return self.runner.model.features(out.hidden_states)

    def propose(self, rows: TargetRows) -> None:
        """Every row reads its next token and the target's features there, on the target's metadata; the head's
        output at each request's last settled row alone, found on the device: the carries."""
        start = time.perf_counter()
        meta = copy.copy(rows.meta)  # not dataclasses.replace, which runs __init__ again (docs/benchmark_history.md)
        meta.output_rows = rows.last_rows
        out = self._run(rows.next_token_ids, meta, rows.last_rows, self.target_features(rows.output))
        # the hidden states at the rows scored: the rows its backend computed alone, or every row's (FlashInfer)
        # (one row a request: those rows; every row: more, whenever a request has more than one row)
        hidden = out.hidden_states if out.hidden_states.shape[0] == len(rows.requests) else out.hidden_states[
            rows.last_rows]
        carry = Carry(out.logits, hidden)
        for row, request in enumerate(rows.requests):
            self._carries[request.request_id] = (carry, row)
        self.seconds += time.perf_counter() - start

    def carried_logits(self, request_id: int) -> Tensor:
        """[V] the logits the request's next first draft comes from."""
        carry, row = self._carries[request_id]
        return carry.logits[row]

    def forget(self, request_id: int) -> None:
        self._carries.pop(request_id, None)

    def _first_logits(self, requests: Sequence[SpeculatingRequest],
                      k: int) -> tuple[Tensor, Tensor, DecodeSteps | None]:
        """The carries, as the last catch-up batched them where it can (same requests, same order: no copy); the
        draft forward j writes position num_computed + j."""
        held = [self._carries[r.request_id] for r in requests]
        carry = held[0][0]
        if all(c is carry for c, _ in held):
            if carry.logits.shape[0] == len(held) and all(row == b for b, (_, row) in enumerate(held)):
                logits, hidden = carry.logits, carry.hidden  # [B, V], [B, H]
            else:
                picked = device_tensor([row for _, row in held], self.device)
                logits, hidden = carry.logits[picked], carry.hidden[picked]
        else:
            logits = torch.stack([c.logits[row] for c, row in held])
            hidden = torch.stack([c.hidden[row] for c, row in held])
        steps = DecodeSteps([r.page_table.pages for r in requests], [r.num_computed for r in requests], k - 1,
                            self.page_size, self.device) if k > 1 else None
        return logits, hidden, steps


class Eagle3Drafter(MTPDrafter):
    """An EAGLE-3 head: step 0 reads its fc-fusion of the target's low, mid and high layers."""

    kind = "eagle3"

    def __init__(self, model: torch.nn.Module, num_pages: int, page_size: int, backend: str,
                 graphs: GraphSettings | None = None) -> None:
        super().__init__(model, num_pages, page_size, backend, graphs)
        self.target_aux_layers = tuple(model.target_aux_layers)

    def target_features(self, out: ModelOutput) -> Tensor:
        aux = torch.stack([out.aux_hidden_states[layer] for layer in self.target_aux_layers], dim=1)  # [T, 3, H]
        return self.runner.model.features(out.hidden_states, aux.to(self.runner.dtype))


DRAFTERS: dict[str, type[Drafter]] = {cls.kind: cls for cls in (DraftModel, MTPDrafter, Eagle3Drafter)}


# The target forward over the verify rows: [B, K+1] token ids -> [B*(K+1), V] their logits (the engine packs them
# beside other requests' rows).
TargetForward = Callable[[Tensor], Tensor]


def speculative_decode(
    target_forward: TargetForward, drafter: Drafter, requests: Sequence[SpeculatingRequest], k: int,
    sampling: SamplingTensors, generators: Sequence[torch.Generator],
) -> tuple[Tensor, Tensor]:
    """One draft-verify-accept round for decode requests whose page tables hold K+1 more positions.

    Returns (emitted [B, K+1], num_emitted [B]) on the device: row b's accepted drafts, then the target's token,
    then -1 padding (`infer.rejection_sampler`)."""
    batch = len(requests)
    draft_ids, draft_probs = drafter.draft(requests, k, sampling, generators)  # [B, K], [B, K, V] | None
    # Verify: the pending token and the K drafts, at positions num_computed .. num_computed + K.
    pending = device_tensor([r.token_ids[-1] for r in requests], draft_ids.device)[:, None]  # [B, 1]
    target_logits = target_forward(torch.cat((pending, draft_ids), dim=1)).view(batch, k + 1, -1)  # [B, K+1, V]
    if draft_probs is None:
        return greedy_verify(draft_ids, target_logits.argmax(-1))
    repeat = lambda t: t.repeat_interleave(k + 1)  # noqa: E731 - per request -> per verified position
    p = target_probs(target_logits.flatten(0, 1), repeat(sampling.temperature), repeat(sampling.top_k),
                     repeat(sampling.top_p), sampling.filtering).view(batch, k + 1, -1)  # [B, K+1, V]
    return rejection_sample(draft_ids, draft_probs, p, generators)


def emitted_lists(emitted: Tensor | list[list[int]]) -> list[list[int]]:
    """[B, K+1] emitted tokens, -1 padded -> each row's tokens on the host."""
    rows = emitted.tolist() if isinstance(emitted, Tensor) else emitted
    return [row[: row.index(-1)] if -1 in row else row for row in rows]


def read_step_tokens(sampled: Tensor | None, emitted: Tensor | None) -> tuple[list[int], list[list[int]]]:
    """A step's one host read: the plain rows' sampled tokens [S] and the verifies' emitted tokens [B, K+1] (-1
    padded) come back in one copy -> (sampled ids, each verify's emitted ids)."""
    parts = [t.flatten() for t in (sampled, emitted) if t is not None]
    if not parts:
        return [], []
    flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).tolist()
    num_sampled = 0 if sampled is None else sampled.shape[0]
    if emitted is None:
        return flat, []
    width = emitted.shape[1]
    verified = flat[num_sampled:]
    return flat[:num_sampled], emitted_lists([verified[i : i + width] for i in range(0, len(verified), width)])
