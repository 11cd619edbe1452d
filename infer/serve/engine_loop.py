"""The engine's own thread, apart from the HTTP handlers: requests join at its next step, their tokens go back to
the handlers' event loop after every step, and a cancelled request leaves (its pages freed) before the next one.

Only this thread touches the engine's requests. Handlers talk to it through an inbox (add, abort) and read
`Update`s from an asyncio queue. A step that raises cannot say whose request broke it: every running request is
requeued (recomputed from its first token, as a preemption does) and they are readmitted one at a time, so the
one that raises again fails alone while the others carry on.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from infer.engine import Engine, Request
from infer.parallel import one_line
from infer.sampling_params import SamplingParams

log = logging.getLogger("infer.serve")


class QueueFull(RuntimeError):
    """The waiting queue holds `max_waiting` requests: the client should retry later."""


@dataclass
class Update:
    """What one step did to one request: its new output ids, and how it ended if it did."""

    index: int  # the choice's index in its HTTP request
    new_ids: list[int]
    finish_reason: str | None = None
    text: str | None = None  # the engine's final text (stop strings cut), once finished
    error: str | None = None  # the request failed inside the engine


@dataclass
class Stream:
    """One engine request as a handler sees it: its updates go to `sink` on the handler's event loop."""

    index: int
    prompt_ids: list[int]
    params: SamplingParams
    sink: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    incremental: bool = True  # an update every step (streamed); False: one update when it ends
    request: Request | None = None  # set by the engine thread when it queues the request
    published: int = 0  # output ids already sent
    done: bool = False

    def push(self, update: Update) -> None:
        self.loop.call_soon_threadsafe(self.sink.put_nowait, update)


@dataclass
class LoopStats:
    """Counters the metrics read; the engine thread writes them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason (or "error") -> requests
    steps: int = 0
    step_s: float = 0.0  # seconds in Engine.step (the rest of the loop's time: inbox, publishing, idle)
    recent: deque = field(default_factory=lambda: deque(maxlen=4096))  # (time, tokens) per step

    def tokens_per_s(self, window_s: float = 10.0) -> float:
        """Generated tokens per second over the last `window_s` seconds."""
        now = time.perf_counter()
        recent = [(t, n) for t, n in list(self.recent) if now - t <= window_s]
        if not recent:
            return 0.0
        span = max(now - recent[0][0], 1e-3)
        return sum(n for _, n in recent) / span


class EngineLoop:
    def __init__(self, engine: Engine, max_waiting: int = 256, idle_wait_s: float = 0.05) -> None:
        """max_waiting: requests queued (not yet running) beyond which `submit` raises QueueFull."""
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        self.engine, self.max_waiting, self.idle_wait_s = engine, max_waiting, idle_wait_s
        self.stats = LoopStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._pending = 0  # adds in the inbox
        self._streams: dict[int, Stream] = {}  # engine request id -> its stream, while it runs
        self._suspects: dict[int, int] = {}  # request id -> its output length when a step raised
        self._max_num_seqs = engine.scheduler.max_num_seqs
        self.error: BaseException | None = None  # what stopped the thread, if anything did
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # --- the handlers' side -----------------------------------------------------------------------
    def start(self) -> "EngineLoop":
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread.is_alive():
            self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def submit(self, streams: Sequence[Stream]) -> None:
        """Queue the streams' requests together, or none of them (QueueFull when the waiting queue is full)."""
        with self._lock:
            if len(self.engine.waiting) + self._pending + len(streams) > self.max_waiting:
                raise QueueFull(f"{len(self.engine.waiting) + self._pending} requests are waiting "
                                f"(max_waiting {self.max_waiting})")
            self._pending += len(streams)
        for stream in streams:
            self._inbox.put(("add", stream))
        self._wake.set()

    def cancel(self, streams: Sequence[Stream]) -> None:
        """Abort the streams' requests (a client went away): their pages are freed before the next step."""
        for stream in streams:
            if not stream.done:
                self._inbox.put(("abort", stream))
        self._wake.set()

    # --- the engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._drain()
                if not self.engine.has_unfinished():
                    self._wake.wait(self.idle_wait_s)
                    continue
                self._step()
        except BaseException as err:  # a bug in the loop itself: say so on /health, fail every open request
            log.exception("the engine loop stopped")
            self.error = err
            for stream in list(self._streams.values()):
                self._fail(stream, f"the engine loop stopped: {one_line(err)}")

    def _drain(self) -> None:
        while True:
            try:
                op, stream = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "add":
                with self._lock:
                    self._pending -= 1
                self._add(stream)
            elif stream.request is not None and not stream.done:
                self.engine.abort(stream.request)
                self._streams.pop(stream.request.request_id, None)
                stream.done = True
                self.stats.finished["abort"] = self.stats.finished.get("abort", 0) + 1

    def _add(self, stream: Stream) -> None:
        try:
            stream.request = self.engine.add_request(stream.prompt_ids, stream.params)
        except Exception as err:  # noqa: BLE001 - this request fails alone
            self._fail(stream, one_line(err))
            return
        self._streams[stream.request.request_id] = stream
        self.stats.prompt_tokens += len(stream.prompt_ids)

    def _step(self) -> None:
        engine = self.engine
        if self._suspects:  # readmit the requeued requests one at a time
            cleared = sum(1 for r in engine.running if r.request_id not in self._suspects)
            engine.scheduler.max_num_seqs = min(self._max_num_seqs, cleared + 1)
        start = time.perf_counter()
        try:
            engine.step()
        except Exception as err:  # noqa: BLE001 - find whose request it was, keep serving the others
            self._after_failed_step(err)
        else:
            self._clear_suspects()
        self.stats.steps += 1
        self.stats.step_s += time.perf_counter() - start
        self._publish()

    def _after_failed_step(self, err: Exception) -> None:
        engine = self.engine
        culprits = [r for r in engine.running if r.request_id in self._suspects and not r.finished]
        log.warning("a step failed (%s): %s", "isolating" if not culprits else "a request fails alone", one_line(err))
        for request in culprits:
            stream = self._streams.get(request.request_id)
            engine.abort(request)
            self._suspects.pop(request.request_id, None)
            if stream is not None:
                self._fail(stream, f"the engine failed on this request: {one_line(err)}")
        for request in engine.requeue_running():
            self._suspects.setdefault(request.request_id, len(request.output_ids))

    def _clear_suspects(self) -> None:
        """A requeued request that got through a step with a new token (or finished) is not the culprit."""
        for request in list(self.engine.running) + [s.request for s in self._streams.values()]:
            start = self._suspects.get(request.request_id)
            if start is not None and (request.finished or len(request.output_ids) > start):
                del self._suspects[request.request_id]
        if not self._suspects:
            self.engine.scheduler.max_num_seqs = self._max_num_seqs

    def _publish(self) -> None:
        """Send each stream its new tokens (and its end); finished ones leave."""
        total = 0
        for request_id, stream in list(self._streams.items()):
            request = stream.request
            n = len(request.output_ids)
            if not request.finished and (n == stream.published or not stream.incremental):
                continue
            new_ids = request.output_ids[stream.published:n]
            total += len(new_ids)
            stream.published = n
            if request.finished:
                del self._streams[request_id]
                self._suspects.pop(request_id, None)
                stream.done = True
                reason = request.finish_reason
                self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
                stream.push(Update(stream.index, new_ids, reason, request.text))
            else:
                stream.push(Update(stream.index, new_ids))
        self.stats.generation_tokens += total
        self.stats.recent.append((time.perf_counter(), total))

    def _fail(self, stream: Stream, message: str) -> None:
        stream.done = True
        if stream.request is not None:
            self._streams.pop(stream.request.request_id, None)
        self.stats.finished["error"] = self.stats.finished.get("error", 0) + 1
        stream.push(Update(stream.index, [], "error", error=message))
