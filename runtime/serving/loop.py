"""The engine loop of the server: one thread owns the `Engine` and its `Scheduler`.

Neither is thread-safe, so everything that touches them happens on that thread: it drains an
inbox of commands (submit, cancel, stats), steps the scheduler while any request is running,
and after each step hands every request's new tokens to its consumer (`Stream`, an asyncio
queue, filled through `call_soon_threadsafe`). Admission is bounded: at most `capacity` rows
running plus `max_queue` waiting; beyond that `submit` raises `QueueFull` at once.

A request that fails (bad input, an expert that cannot be read) fails alone. An exception out
of a step fails every request in flight with its message, the rows are freed and the loop
goes on with a fresh scheduler: nothing waits forever on a dead loop.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import jax

from strata_jax.batching import packing
from strata_jax.batching.checks import check_request
from strata_jax.batching.scheduler import Request, Scheduler
from strata_jax.step.sampling import GREEDY, SamplingParams

log = logging.getLogger("strata.serve")


class QueueFull(RuntimeError):
    """Every row is busy and the waiting queue is full (HTTP 429)."""


class ShuttingDown(RuntimeError):
    """The loop no longer accepts requests (HTTP 503)."""


@dataclass(frozen=True, kw_only=True)
class Update:
    """What one step did for one request."""

    tokens: tuple[int, ...]
    """Ids generated since the last update."""
    done: bool = False
    """The request is over: no update follows."""
    error: str | None = None
    """Why it failed (then `done`)."""
    cancelled: bool = False
    """It was cancelled (then `done`)."""
    scores: packing.PromptScores | None = None
    """The prompt's `packing.PromptScores`, on the update with the first token (requests
    submitted with `score_prompt`)."""
    logprobs: tuple[packing.TokenScore, ...] = ()
    """Each of `tokens`' scores (requests submitted with `logprobs`)."""


class Stream:
    """The consumer side of one request: `async for update in stream`."""

    def __init__(self, rid: int, loop: asyncio.AbstractEventLoop) -> None:
        self.id = rid
        self._loop = loop
        self._updates: asyncio.Queue[Update] = asyncio.Queue()
        self._over = False

    def post(self, update: Update) -> None:
        """From the engine thread."""
        try:
            self._loop.call_soon_threadsafe(self._updates.put_nowait, update)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Update:
        if self._over:
            raise StopAsyncIteration
        update = await self._updates.get()
        self._over = update.done
        return update


@dataclass(kw_only=True)
class ServingCounters:
    """Request counters since start-up (monotonic)."""

    accepted: int = 0
    """Requests taken into the loop."""
    rejected: int = 0
    """Refused because the queue was full."""
    finished: int = 0
    """Ended normally (a stop id or string, or the token limit)."""
    failed: int = 0
    """Ended with an error."""
    cancelled: int = 0
    """Cancelled (client gone, shutdown)."""
    engine_errors: int = 0
    """Exceptions out of a step (each fails the requests then in flight)."""
    generated_tokens: int = 0
    """Tokens generated for requests (prefill's first token included)."""


@dataclass(kw_only=True)
class _Job:
    stream: Stream
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    score_prompt: bool = False
    logprobs: bool = False
    request: Request | None = None
    sent: int = 0


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """The loop's state and the engine's stats, read on the engine thread."""

    engine: dict[str, object]
    """`Engine.stats()`."""
    counters: ServingCounters
    """Copy of the request counters."""
    active_rows: int
    """Rows decoding a request."""
    queue_depth: int
    """Requests accepted and waiting for a row."""
    capacity: int
    """Rows of the batch."""
    decode_tokens: int
    """Tokens decoded by steps (after warm-up of the decode program)."""
    prefill_tokens: int
    """Prompt tokens prefilled."""
    scheduler_steps: int
    """Scheduler steps since the last engine error."""
    compiles: int
    """XLA compilations in this process (cache loads included)."""
    compile_s: float
    """Seconds spent in them."""
    uptime_s: float
    """Seconds since the loop started."""


class _CompileCounter:
    """XLA backend compilations in this process, from jax.monitoring (registered once)."""

    def __init__(self) -> None:
        self.count, self.seconds = 0, 0.0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            with self._lock:
                self.count += 1
                self.seconds += duration


COMPILES = _CompileCounter()


@dataclass(kw_only=True)
class _Command:
    kind: str  # "submit" | "cancel" | "snapshot" | "stop"
    job: _Job | None = None
    stream: Stream | None = None
    stopped: bool = False
    reply: Future | None = None
    deadline: float = 0.0


@dataclass(kw_only=True)
class _State:
    jobs: dict[int, _Job] = field(default_factory=dict)  # stream id -> job, in flight
    stopping: bool = False
    deadline: float = 0.0


class EngineLoop:
    """Runs `engine` on its own thread for asyncio consumers. `start`, then `submit` from any
    thread; `shutdown` to stop."""

    def __init__(self, engine, *, max_queue: int) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.capacity, self.max_len = engine.capacity, engine.max_len
        self.max_queue = max_queue
        self.counters = ServingCounters()
        self._scheduler = Scheduler(engine)
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._lock = threading.Lock()  # in_flight, accepting, ids and counters
        self._in_flight = 0
        self._accepting = True
        self._next_id = 0
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="strata-engine", daemon=True)

    # --- any thread -------------------------------------------------------------------------

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread.start()

    def submit(self, prompt: list[int], max_new_tokens: int,
               sampling: SamplingParams = GREEDY, score_prompt: bool = False,
               logprobs: bool = False) -> Stream:
        """Queue a request (ValueError if it is malformed, QueueFull, ShuttingDown);
        `score_prompt`: its prompt's log-probabilities come with its first token; `logprobs`:
        each generated token's with it (`Update.logprobs`)."""
        check_request(self.engine.cfg, 0, prompt, max_new_tokens, self.max_len)
        with self._lock:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            if self._in_flight >= self.capacity + self.max_queue:
                self.counters.rejected += 1
                raise QueueFull(f"all {self.capacity} rows are busy and {self.max_queue} "
                                "requests are waiting: retry later")
            self._in_flight += 1
            self.counters.accepted += 1
            rid, self._next_id = self._next_id, self._next_id + 1
        stream = Stream(rid, asyncio.get_running_loop())
        job = _Job(stream=stream, prompt=list(prompt), max_new_tokens=max_new_tokens,
                   sampling=sampling, score_prompt=score_prompt, logprobs=logprobs)
        self._inbox.put(_Command(kind="submit", job=job))
        return stream

    def cancel(self, stream: Stream, stopped: bool = False) -> None:
        """End the request now (a finished one is left alone); its row is freed. `stopped`:
        it reached a stop string, so it counts as finished, not cancelled."""
        self._inbox.put(_Command(kind="cancel", stream=stream, stopped=stopped))

    def snapshot(self) -> Future[Snapshot]:
        """The state, read between two steps."""
        reply: Future[Snapshot] = Future()
        self._inbox.put(_Command(kind="snapshot", reply=reply))
        return reply

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def begin_shutdown(self, drain_s: float = 10.0) -> None:
        """Stop accepting and let the requests in flight finish for up to `drain_s` seconds;
        then they are cancelled (their streams end with `cancelled`). Returns at once; the
        first call sets the deadline."""
        with self._lock:
            if not self._accepting:
                return
            self._accepting = False
        self._inbox.put(_Command(kind="stop", deadline=time.monotonic() + drain_s))

    def shutdown(self, drain_s: float = 10.0) -> None:
        """`begin_shutdown` (if not begun), then join the thread and close the engine."""
        self.begin_shutdown(drain_s)
        if self._thread.is_alive():
            self._thread.join()
        self.engine.close()

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        state = _State()
        while True:
            busy = bool(state.jobs) or state.stopping  # stopping: leave once the jobs end
            for command in self._drain(block=not busy):
                self._handle(command, state)
            if state.stopping and (not state.jobs or time.monotonic() >= state.deadline):
                for job in list(state.jobs.values()):
                    self._cancel(job, state, error="the server shut down before it finished")
                return
            if state.jobs:
                self._step(state)

    def _drain(self, block: bool) -> list[_Command]:
        commands = [self._inbox.get()] if block else []
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _handle(self, command: _Command, state: _State) -> None:
        if command.kind == "submit":
            self._admit(command.job, state)
        elif command.kind == "cancel":
            job = state.jobs.get(command.stream.id)
            if job is not None:
                self._cancel(job, state, stopped=command.stopped)
        elif command.kind == "snapshot":
            try:
                command.reply.set_result(self._snapshot(state))
            except Exception as err:  # noqa: BLE001  (handed to the caller)
                command.reply.set_exception(err)
        elif command.kind == "stop":
            state.stopping, state.deadline = True, command.deadline

    def _admit(self, job: _Job, state: _State) -> None:
        try:
            job.request = self._scheduler.submit(job.prompt, job.max_new_tokens, job.sampling,
                                                 score_prompt=job.score_prompt,
                                                 logprobs=job.logprobs)
        except Exception as err:  # noqa: BLE001  (this request's input; the others go on)
            self._finish(job, state, error=str(err))
            return
        state.jobs[job.stream.id] = job

    def _step(self, state: _State) -> None:
        try:
            self._scheduler.step()
        except Exception as err:  # noqa: BLE001  (fail the requests in flight, keep serving)
            log.exception("engine step failed; failing %d requests", len(state.jobs))
            with self._lock:
                self.counters.engine_errors += 1
            self._reset_scheduler()
            for job in list(state.jobs.values()):
                unsent = tuple(job.request.tokens[job.sent :])
                self._finish(job, state, tokens=unsent,
                             logprobs=tuple(job.request.token_scores[job.sent :]),
                             error=f"engine error: {type(err).__name__}: {err}")
            return
        for job in list(state.jobs.values()):
            self._publish(job, state)

    def _publish(self, job: _Job, state: _State) -> None:
        req = job.request
        new = tuple(req.tokens[job.sent :])
        scores = req.scores if new and not job.sent else None  # with the first token
        scored = tuple(req.token_scores[job.sent :])
        job.sent = len(req.tokens)
        if req.done:
            self._finish(job, state, tokens=new, error=req.error, scores=scores,
                         logprobs=scored)
        elif new:
            job.stream.post(Update(tokens=new, scores=scores, logprobs=scored))
            with self._lock:
                self.counters.generated_tokens += len(new)

    def _cancel(self, job: _Job, state: _State, error: str | None = None,
                stopped: bool = False) -> None:
        new: tuple[int, ...] = ()
        scored: tuple[packing.TokenScore, ...] = ()
        if job.request is not None:
            self._scheduler.cancel(job.request)
            new = tuple(job.request.tokens[job.sent :])
            scored = tuple(job.request.token_scores[job.sent :])
        self._finish(job, state, tokens=new, error=error, cancelled=not stopped,
                     logprobs=scored)

    def _finish(self, job: _Job, state: _State, tokens: tuple[int, ...] = (),
                error: str | None = None, cancelled: bool = False, scores=None,
                logprobs: tuple[packing.TokenScore, ...] = ()) -> None:
        state.jobs.pop(job.stream.id, None)
        with self._lock:  # before the post: a consumer told "done" may submit at once
            self._in_flight -= 1
            self.counters.generated_tokens += len(tokens)
            if cancelled:
                self.counters.cancelled += 1
            elif error is not None:
                self.counters.failed += 1
            else:
                self.counters.finished += 1
        job.stream.post(Update(tokens=tokens, done=True, error=error, cancelled=cancelled,
                               scores=scores, logprobs=logprobs))

    def _reset_scheduler(self) -> None:
        """After an exception out of a step: free every row, start a fresh scheduler."""
        for row in range(self.capacity):
            try:
                self.engine.free(row)
            except Exception:  # noqa: BLE001  (best effort on a broken engine)
                log.exception("freeing row %d failed", row)
        self._scheduler = Scheduler(self.engine)

    def _snapshot(self, state: _State) -> Snapshot:
        sched, counters = self._scheduler, self.engine.counters
        active = sum(r is not None and not r.done for r in sched.rows)
        with self._lock:
            copy = ServingCounters(**vars(self.counters))
        return Snapshot(
            engine=self.engine.stats(), counters=copy, active_rows=active,
            queue_depth=len(sched.queue), capacity=self.capacity,
            decode_tokens=counters.decode_tokens, prefill_tokens=counters.prefill_tokens,
            scheduler_steps=sched.steps, compiles=COMPILES.count, compile_s=COMPILES.seconds,
            uptime_s=time.monotonic() - self._started)


def warm_up(engine) -> None:
    """Compile every program a request can need before serving: each prefill shape that
    `packing.pack` can give (rows x tokens) and that fits `max_len`, decode with and without
    the sampler; then zero the engine's stats."""
    sampled = SamplingParams(temperature=1.0, top_k=8, top_p=0.9, min_p=0.01,
                             repetition_penalty=1.1, seed=0)
    most = min(engine.capacity, engine.prefill_rows)
    for sampling in (GREEDY, sampled):
        for rows, tokens in packing.shapes(engine.prefill_chunk, engine.prefill_rows):
            count = min(rows, most)  # prompts admitted together: the shape's row bucket
            n = min(tokens, engine.max_len - 1)  # the longest prompt of this bucket that fits
            if max(1, 1 << (count - 1).bit_length()) != rows:
                continue  # more rows than the batch admits at once
            sched = Scheduler(engine)
            for _ in range(count):
                sched.submit([1] * n, min(3, engine.max_len - n), sampling)
            sched.run()
    engine.reset_stats()
