"""Who runs this step, with how many new tokens: the request queues under a token budget and a page budget.

Running requests come first (a decode is one token; a long prompt is prefilled in chunks), then waiting ones while
the budget, the pages and `max_num_seqs` allow. When pages run out, the most recently admitted request is
preempted: its pages are freed and it is requeued, to be recomputed from its first token. With a drafter attached,
the decodes that have room for K more tokens speculate (`speculating`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from infer.engine.request import Request
from infer.kv_cache import OutOfPages, PagePool


class Scheduler:
    def __init__(self, pool: PagePool, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 on_preempt: Callable[[Request], None]) -> None:
        """on_preempt: called with each preempted request once its pages are freed (its drafter state goes too)."""
        self.pool, self.max_num_seqs, self.budget, self.max_model_len = (pool, max_num_seqs, max_num_batched_tokens,
                                                                         max_model_len)
        self.on_preempt = on_preempt
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Request, int]]:
        """Pick (request, number of new tokens) pairs for this step under the token and page budgets; their page
        tables are extended to hold them."""
        budget = self.budget
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
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
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

    def speculating(self, scheduled: list[tuple[Request, int]], k: int) -> list[Request]:
        """The decodes that verify K drafts this step: the step's token budget, the context and the page pool have
        room for K more tokens each (their pages are reserved here). The drafter has seen every position before
        their pending token (it reads every target forward's rows), so it can draft for them."""
        budget = self.budget - sum(q_len for _, q_len in scheduled)
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

    def remove_finished(self) -> None:
        self.running = [r for r in self.running if not r.finished]

    def _preempt_newest(self) -> Request:
        victim = self.running[-1]
        self.requeue(victim)
        return victim

    def requeue(self, request: Request) -> None:
        """Preempt a running request: free its pages and queue it first, to be recomputed from its first token."""
        self.running.remove(request)
        request.page_table.free()
        request.num_computed = 0
        request.num_preemptions += 1
        self.on_preempt(request)
        self.waiting.appendleft(request)

    def drop(self, request: Request) -> None:
        """Take a request out of the queues wherever it is, its pages freed (an abort)."""
        if request in self.waiting:
            self.waiting.remove(request)
        if request in self.running:
            self.running.remove(request)
        request.page_table.free()
