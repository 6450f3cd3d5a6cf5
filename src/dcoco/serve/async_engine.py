"""The serving loop: one background thread owns a `SpeculativeEngine` and steps it while requests are
pending; asyncio handlers submit requests and read their tokens from per-request queues.

Only the engine thread touches the engine. Handlers hand requests over through a lock-protected inbox,
and the thread pushes events back with `loop.call_soon_threadsafe`. The engine already does continuous
batching (requests join and leave between steps); this loop adds

- a bounded queue (`max_queue` requests waiting to join the batch; beyond it `QueueFullError`),
- an optional tokens-in-flight bound: a request joins the batch only while the sum over the batch of
  prompt + max_tokens + draft block stays under `max_tokens_in_flight` (a request always joins an
  empty batch, so a large one never starves),
- cancellation (`abort`): the request leaves the queue or the batch at the next step boundary,
- fault isolation: an error while post-processing one request (detokenizing, delivering) fails that
  request alone. An exception inside a batched engine step cannot be pinned on one request, so the
  engine is rebuilt and every request of that batch is restarted on its own ("solo", one at a time):
  a request that fails alone gets the error, the others finish normally. A restarted stream that
  had already sent tokens continues only if its regeneration reproduces them (greedy or seeded
  sampling); otherwise it gets an error rather than a silently different continuation.
- graceful shutdown: `shutdown(drain=True)` refuses new requests and returns once everything in
  flight has finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..engine import Request, SpeculativeEngine
from ..errors import DcocoError
from ..sampling import SamplingParams
from .metrics import ServerMetrics

log = logging.getLogger("dcoco.serve")


class QueueFullError(DcocoError):
    """The waiting queue is full: the client should retry later (HTTP 503)."""


class ShuttingDownError(DcocoError):
    """The server is draining and takes no new requests (HTTP 503)."""


class EngineFault(RuntimeError):
    """A request could not be completed because of an internal error (HTTP 500)."""


@dataclass
class Event:
    """A piece of one request's output: new text and token ids; `finish_reason` on the last one."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: Optional[BaseException] = None


class Handle:
    """Server-side state of one engine request (one choice of an HTTP request)."""

    def __init__(
        self,
        rid: int,
        index: int,
        prompt_ids: list[int],
        params: SamplingParams,
        stream: bool,
        sub: "Submission",
        draft_room: int,
    ):
        self.rid = rid
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.stream = stream
        self.sub = sub
        self.arrival = time.perf_counter()
        self.reserve = len(prompt_ids) + params.max_tokens + draft_room
        self.req: Optional[Request] = None
        self.sent_ids: list[int] = []
        self.sent_text = ""
        self.counted = 0  # tokens already added to the generation-tokens counter
        self.admitted = False
        self.first_token = False
        self.suspect = False  # restarted after an engine fault: runs alone
        self.done = False
        self.holdback = max((len(s) for s in params.stop), default=1) - 1

    def push(self, ev: Event) -> None:
        self.sub.push(ev)


class Submission:
    """One HTTP request's engine requests, and the asyncio queue their events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.handles: list[Handle] = []

    def push(self, ev: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)
        except RuntimeError:  # the client's event loop is gone
            pass

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)


class AsyncEngine:
    def __init__(
        self,
        engine: SpeculativeEngine,
        metrics: ServerMetrics,
        max_queue: int = 256,
        max_tokens_in_flight: Optional[int] = None,
    ):
        self.target = engine.target
        self.metrics = metrics
        self.max_queue = int(max_queue)
        self.max_tokens_in_flight = max_tokens_in_flight
        self.policy = engine.draft_policy  # the caller's policy; _prepare wraps it to record k
        self._engine = self._prepare(engine)
        self._ids = itertools.count()
        self._cv = threading.Condition()
        self._inbox: list[Handle] = []
        self._aborts: set[int] = set()
        self._queued = 0  # submitted, not yet in the batch (guarded by _cv)
        self._stopping = False
        self._drain = True
        self._pending: deque[Handle] = deque()  # engine thread only
        self._active: dict[int, Handle] = {}  # in the engine batch; engine thread only
        self._reserved = 0
        self._solo: Optional[int] = None
        self._thread: Optional[threading.Thread] = None

    # -- engine construction --------------------------------------------------------------------
    def _prepare(self, engine: SpeculativeEngine) -> SpeculativeEngine:
        policy = engine.draft_policy
        metrics = self.metrics

        def recorded(batch_size: int, default_k: int) -> int:
            k = int(policy(batch_size, default_k)) if policy is not None else default_k
            metrics.block_size = k
            return k

        if engine.drafter is not None:
            engine.draft_policy = recorded
        engine.on_pass.append(lambda req, drafted, accepted: metrics.on_pass(drafted, accepted))
        return engine

    def _fresh_engine(self) -> SpeculativeEngine:
        old = self._engine
        eng = SpeculativeEngine(
            old.target, old.drafter, old.num_speculative_tokens, old.max_batch_size, draft_policy=self.policy
        )
        return self._prepare(eng)

    @property
    def engine(self) -> SpeculativeEngine:
        return self._engine

    @property
    def draft_room(self) -> int:
        return self._engine.num_speculative_tokens + 1

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="dcoco-engine", daemon=True)
        self._thread.start()

    def shutdown(self, drain: bool = True, timeout: Optional[float] = None) -> None:
        """Refuse new requests; with `drain`, return once everything in flight has finished."""
        with self._cv:
            self._stopping = True
            self._drain = drain
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def accepting(self) -> bool:
        """Running and taking new requests (not draining)."""
        return self.running and not self._stopping

    def load(self) -> tuple[int, int]:
        """(requests in the batch, requests waiting)."""
        return self.metrics.running, self.metrics.waiting

    # -- requests (event-loop side) -------------------------------------------------------------
    def submit(self, prompts: Sequence[list[int]], params: SamplingParams, stream: bool) -> Submission:
        sub = Submission(asyncio.get_running_loop())
        with self._cv:
            if self._stopping:
                raise ShuttingDownError("the server is shutting down")
            if self._queued + len(prompts) > self.max_queue:
                raise QueueFullError(f"the request queue is full ({self.max_queue} waiting); retry later")
            for i, p in enumerate(prompts):
                h = Handle(next(self._ids), i, list(p), params, stream, sub, self.draft_room)
                sub.handles.append(h)
                self._inbox.append(h)
            self._queued += len(prompts)
            self.metrics.set_load(self.metrics.running, self._queued)
            self._cv.notify_all()
        return sub

    def abort(self, sub: Submission) -> None:
        """Cancel every unfinished request of `sub` (its client went away)."""
        ids = [h.rid for h in sub.handles if not h.done]
        if not ids:
            return
        with self._cv:
            self._aborts.update(ids)
            self._cv.notify_all()

    # -- the loop (engine thread) -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (
                    self._inbox
                    or self._aborts
                    or self._stopping
                    or self._active
                    or (self._pending and self._can_admit())
                ):
                    self._cv.wait()
                inbox, self._inbox = self._inbox, []
                aborts, self._aborts = self._aborts, set()
                stopping, drain = self._stopping, self._drain
            try:
                self._pending.extend(inbox)
                if stopping and not drain:
                    aborts |= {h.rid for h in self._pending} | set(self._active)
                self._apply_aborts(aborts)
                if stopping and not self._pending and not self._active:
                    return
                self._admit()
                if self._active:
                    self._step()
            except Exception as e:  # a bug in this loop: fail what is in flight, keep serving
                log.exception("serving loop error")
                self._fault(e, isolate=False)
            finally:
                self._publish_load()

    def _can_admit(self) -> bool:
        return self._solo is None and (not self._active or not self._pending[0].suspect)

    def _publish_load(self) -> None:
        with self._cv:
            self.metrics.set_load(len(self._active), self._queued)

    def _apply_aborts(self, aborts: set[int]) -> None:
        if not aborts:
            return
        for h in [h for h in self._pending if h.rid in aborts]:
            self._pending.remove(h)
            with self._cv:
                self._queued -= 1
            self._finish(h, "abort")
        for rid in aborts:
            h = self._active.get(rid)
            if h is not None:
                self._engine.abort(rid)
                self._leave(h)
                self._finish(h, "abort")

    def _admit(self) -> None:
        eng = self._engine
        while self._pending and self._solo is None:
            h = self._pending[0]
            n = len(self._active)
            if h.suspect and n:
                break
            if n >= eng.max_batch_size:
                break
            if n and self.max_tokens_in_flight and self._reserved + h.reserve > self.max_tokens_in_flight:
                break
            self._pending.popleft()
            with self._cv:
                self._queued -= 1
            try:
                h.req = eng.add_request(h.prompt_ids, h.params, request_id=h.rid)
            except Exception as e:  # bad input that slipped past validation: this request only
                self._fail(h, e)
                continue
            self._active[h.rid] = h
            self._reserved += h.reserve
            if not h.admitted:
                h.admitted = True
                self.metrics.admitted(time.perf_counter() - h.arrival)
                self.metrics.add_prompt(len(h.prompt_ids))
            if h.suspect:
                self._solo = h.rid

    def _step(self) -> None:
        try:
            finished = self._engine.step()
        except Exception as e:
            log.exception("engine step failed (batch of %d)", len(self._active))
            self._fault(e, isolate=True)
            return
        done = {r.request_id for r in finished}
        for rid, h in list(self._active.items()):
            try:
                self._deliver(h, rid in done)
            except Exception as e:  # post-processing failed: this request alone
                log.exception("request %d failed", rid)
                if rid not in done:
                    self._engine.abort(rid)
                self._leave(h)
                self._fail(h, e)
                continue
            if rid in done:
                self._leave(h)

    def _leave(self, h: Handle) -> None:
        if self._active.pop(h.rid, None) is not None:
            self._reserved -= h.reserve
        if self._solo == h.rid:
            self._solo = None

    def _deliver(self, h: Handle, finished: bool) -> None:
        req = h.req
        ids = req.output_ids
        n = len(ids)
        now = time.perf_counter()
        if n and not h.first_token:
            h.first_token = True
            self.metrics.first_token(now - h.arrival)
        if n > h.counted:
            self.metrics.add_generated(n - h.counted)
            h.counted = n
        m = min(n, len(h.sent_ids))
        if ids[:m] != h.sent_ids[:m]:
            raise EngineFault(
                "the request was restarted after an engine error and its regeneration "
                "diverged from the tokens already streamed"
            )
        if finished:
            text = req.text or ""
            new_text = text[len(h.sent_text) :] if text.startswith(h.sent_text) else ""
            ev = Event(
                h.index, new_text, list(ids[len(h.sent_ids) :]), req.finish_reason or "length", len(h.prompt_ids), n
            )
            h.sent_ids, h.sent_text = list(ids), text
            self._finish(h, ev.finish_reason, ev)
            return
        if not h.stream or n <= len(h.sent_ids):
            return
        text = self.target.decode(ids).rstrip("\ufffd")  # hold back an incomplete UTF-8 sequence
        if h.holdback:  # a stop string may still be forming at the end: hold back its length - 1
            text = text[: max(len(h.sent_text), len(text) - h.holdback)]
        if len(text) > len(h.sent_text) and text.startswith(h.sent_text):
            h.push(Event(h.index, text[len(h.sent_text) :], list(ids[len(h.sent_ids) :])))
            h.sent_ids, h.sent_text = list(ids), text

    def _finish(self, h: Handle, reason: str, ev: Optional[Event] = None) -> None:
        if h.done:
            return
        h.done = True
        self.metrics.finish(reason, time.perf_counter() - h.arrival)
        h.push(ev if ev is not None else Event(h.index, finish_reason=reason))

    def _fail(self, h: Handle, err: BaseException) -> None:
        if h.done:
            return
        h.done = True
        self.metrics.finish("error", time.perf_counter() - h.arrival)
        h.push(Event(h.index, finish_reason="error", error=err))

    def _fault(self, err: BaseException, isolate: bool) -> None:
        """The engine step (or the loop) failed: rebuild the engine; with `isolate`, restart the
        batch's requests one at a time so that only the culprit fails."""
        affected = list(self._active.values())
        drafter = self._engine.drafter
        for h in affected:
            if drafter is not None:
                try:
                    drafter.release(h.rid)
                except Exception:
                    pass
        self._active.clear()
        self._reserved = 0
        self._solo = None
        self._engine = self._fresh_engine()
        if not isolate or len(affected) == 1:
            for h in affected:
                self._fail(h, err if isinstance(err, DcocoError) else EngineFault(f"internal error: {err}"))
            return
        restart = []
        for h in affected:
            replayable = h.params.greedy or h.params.seed is not None
            if h.suspect or (h.sent_ids and not replayable):
                self._fail(h, EngineFault(f"internal error: {err}"))
            else:
                h.suspect, h.req = True, None
                restart.append(h)
        for h in reversed(restart):
            self._pending.appendleft(h)
        with self._cv:
            self._queued += len(restart)
