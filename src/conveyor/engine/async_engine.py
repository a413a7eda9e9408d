"""The LLMEngine step loop in its own thread, with one async stream of outputs per request.

``LLMEngine`` is not thread-safe, so only the loop thread changes it: the event loop queues
commands (add, abort) that the loop thread applies between steps (other threads only
tokenize, check prompts and compile grammars: reads of the tokenizer and config, and the
grammar cache, which has its own lock), and the loop thread hands
each step's outputs back to the event loop in one ``call_soon_threadsafe``. A forward pass
never blocks the event loop, and the loop thread sleeps on a condition when there is no work.

A request's stream holds one unread output: a newer cumulative output replaces it, a newer
delta (``output_kind=DELTA``, what the server asks for) is appended to it, so a consumer that
falls behind reads fewer, larger updates instead of a growing queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from conveyor.engine.stats import EngineStats
from conveyor.outputs import RequestOutput
from conveyor.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from conveyor.engine.llm_engine import LLMEngine, PromptType

logger = logging.getLogger(__name__)

# Seconds a client is told to wait (Retry-After) when the waiting queue is full.
RETRY_AFTER_S = 1
# How long shutdown waits for the loop thread to finish its current step.
THREAD_JOIN_TIMEOUT_S = 10.0

# Called in the loop thread after every loop iteration: (outputs of this iteration, including
# aborted requests' final outputs; the engine's stats snapshot; time.time() at the end).
StepListener = Callable[[list[RequestOutput], EngineStats, float], None]


class EngineDeadError(RuntimeError):
    """A step raised: the engine can serve no more requests (health turns 503)."""


class RequestFailedError(RuntimeError):
    """The engine step that ran this request failed (the engine logged why); the engine and
    the other requests go on. An internal error (HTTP 500), not the client's fault."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"internal error: request {request_id} failed inside an engine step")
        self.request_id = request_id


class EngineStoppedError(RuntimeError):
    """The engine is shutting down and takes no new requests."""


class QueueFullError(RuntimeError):
    """The requests waiting beyond the free sequence slots are at --max-queued-requests:
    back-pressure (HTTP 429)."""

    def __init__(self, num_waiting: int, limit: int) -> None:
        super().__init__(f"the server is overloaded: {num_waiting} requests are waiting "
                         f"for a free slot (limit {limit}); retry after {RETRY_AFTER_S}s")
        self.retry_after_s = RETRY_AFTER_S


@dataclass
class _Add:
    prompt: PromptType
    params: SamplingParams
    request_id: str
    priority: int
    user: str | None
    done: asyncio.Future[None]


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """One request's outputs (of its output_kind), read with ``async for``; ``close()``
    aborts it."""

    def __init__(self, request_id: str, engine: AsyncEngine,
                 kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.request_id = request_id
        self._engine = engine
        self._deltas = kind == RequestOutputKind.DELTA
        self._owned = False  # _latest is a copy of this stream's (deltas appended to it)
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()
        self.finished = False  # the final output was delivered (to this object)
        self._exhausted = False  # the final output was read

    # -- called on the event loop by the engine
    def _put(self, output: RequestOutput) -> None:
        if self._deltas and self._latest is not None:  # unread: append the new delta
            if not self._owned:
                self._latest, self._owned = self._latest.copy(), True
            self._latest.add(output)
        else:
            self._latest, self._owned = output, False
        self.finished = self.finished or output.finished
        self._event.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self.finished = True  # nothing left to abort
        self._event.set()

    # -- the consumer's side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            if self._latest is not None:
                output, self._latest = self._latest, None
                self._exhausted = output.finished
                return output
            if self._exhausted:
                raise StopAsyncIteration
            if self._error is not None:
                raise self._error
            self._event.clear()
            await self._event.wait()

    def close(self) -> None:
        """Abort the request unless it finished (idempotent)."""
        if not self.finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Drives an LLMEngine from a background thread for many concurrent async callers."""

    def __init__(self, engine: LLMEngine, max_queued_requests: int | None = None,
                 listener: StepListener | None = None) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.listener = listener
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []  # guarded by _cond
        self._stop_thread = False  # guarded by _cond
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # event loop only
        # Sequences of adds queued but not yet in a stats snapshot; guarded by _cond and
        # changed together with `stats`, so that back-pressure counts each request once.
        self._num_unapplied_seqs = 0
        self._accepting = True
        self.dead_error: BaseException | None = None
        # Called on the event loop once the engine died (`conveyor serve` exits non-zero).
        self.on_dead: Callable[[BaseException], None] | None = None
        # Read by the event loop, replaced (never mutated) by the loop thread.
        self.stats: EngineStats = engine.stats()
        self.peak_num_running = 0

    # ------------------------------------------------------------------ read-only engine info
    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every served name (--served-model-name): requests may give any."""
        return self.engine.model_names

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def default_sampling(self) -> dict[str, Any]:
        """The model's sampling defaults (``LLMEngine.default_sampling``)."""
        return self.engine.default_sampling

    @property
    def max_model_len(self) -> int:
        return self.engine.scheduler_config.max_model_len

    @property
    def hidden_size(self) -> int:
        """The size of the model's hidden states (an embedding's)."""
        return self.engine.model_config.hidden_size

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """Safe from any thread: reads only the tokenizer and the model config."""
        return self.engine.tokenize_prompt(prompt)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        self.engine.check_token_ids(ids, field)

    def check_prompt_chars(self, text: str, field: str) -> None:
        """Safe from any thread, like tokenize_prompt."""
        self.engine.check_prompt_chars(text, field)

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    @property
    def is_accepting(self) -> bool:
        """False once shutdown began (or before start): new requests are refused."""
        return self._accepting and self._thread is not None and self.dead_error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the loop thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run_loop, name="conveyor-engine",
                                        daemon=True)
        self._thread.start()

    def stop_accepting(self) -> None:
        """New requests get EngineStoppedError from now on (HTTP 503)."""
        self._accepting = False

    def fail_unfinished(self, error: BaseException) -> None:
        """End every unfinished request now: its stream raises `error` (after any output it
        has not read), and the engine aborts it, which frees its KV blocks."""
        request_ids = list(self._streams)
        self._fail_all(error)
        for request_id in request_ids:
            self.abort(request_id)

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Stop accepting requests, let in-flight ones finish within timeout_s, end the rest
        with EngineStoppedError, and stop the loop thread."""
        self.stop_accepting()
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self.dead_error is None:
            await asyncio.sleep(0.05)
        self.fail_unfinished(EngineStoppedError("the server is shutting down"))
        with self._cond:
            self._stop_thread = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, THREAD_JOIN_TIMEOUT_S)

    # ------------------------------------------------------------------ requests
    async def compile_grammar(self, params: SamplingParams) -> None:
        """Compile a request's constraint in a worker thread (the engine then finds it in the
        cache); GrammarError (a ValueError) when it is refused."""
        if params.structured_outputs is not None:
            await asyncio.to_thread(self.engine.compile_grammar, params, False)

    async def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str,
                          priority: int = 0, user: str | None = None) -> RequestStream:
        """Queue a request; returns its stream once the engine accepted it.

        Raises ValueError (bad input, from the engine), QueueFullError, EngineDeadError or
        EngineStoppedError before anything is streamed.
        """
        self._check_accepting(params.n)
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        await self.compile_grammar(params)  # off the loop
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, self, params.output_kind)
        done: asyncio.Future[None] = loop.create_future()
        self._streams[request_id] = stream
        self._submit(_Add(prompt, params, request_id, priority, user, done))
        try:
            await done
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller went away; the add may have happened
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams, request_id: str,
                       priority: int = 0, user: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """The outputs of one request; leaving the loop early aborts it."""
        stream = await self.add_request(prompt, params, request_id, priority, user)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request between steps (idempotent; unknown or finished ids are ignored)."""
        if self._thread is not None and self._thread.is_alive():
            self._submit(_Abort(request_id))

    def _check_accepting(self, num_seqs: int) -> None:
        if self.dead_error is not None:
            # The client learns that, not why: the traceback is in the server's log.
            raise EngineDeadError("the engine failed and serves no more requests")
        if not self._accepting or self._thread is None:
            raise EngineStoppedError("the server is shutting down")
        limit = self.max_queued_requests
        if limit is not None:
            num_queued = self._num_queued_beyond_slots(num_seqs)
            if num_queued > limit:
                raise QueueFullError(max(num_queued - num_seqs, 0), limit)

    def _num_queued_beyond_slots(self, num_new_seqs: int) -> int:
        """Sequences that would wait, with `num_new_seqs` more, beyond the free slots under
        max_num_seqs: those that free slots take at the next step do not queue (from an idle
        server, a burst as large as max_num_seqs all runs at once)."""
        with self._cond:
            stats, unapplied = self.stats, self._num_unapplied_seqs
        free_slots = self.engine.scheduler_config.max_num_seqs - int(
            stats.num_requests_running)
        waiting = stats.num_requests_waiting + unapplied + num_new_seqs
        return max(waiting - max(free_slots, 0), 0)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._cond:
            self._commands.append(command)
            if isinstance(command, _Add):
                self._num_unapplied_seqs += command.params.n
            self._cond.notify()

    # ------------------------------------------------------------------ the loop thread
    def _run_loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while (not self._commands and not self._stop_thread
                       and not engine.has_unfinished_requests()):
                    self._cond.wait()
                if self._stop_thread and not self._commands:
                    return
                commands, self._commands = self._commands, []
            try:
                outputs = self._apply(commands)
                if engine.has_unfinished_requests():
                    outputs.extend(engine.step())
                self._publish(outputs)
            except BaseException as e:  # a step failed: nothing can be trusted any more
                logger.exception("engine step failed; the engine is dead")
                self._die(e)
                return

    def _apply(self, commands: list[_Add | _Abort]) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        resolved: list[tuple[asyncio.Future[None], BaseException | None]] = []
        for command in commands:
            if isinstance(command, _Abort):
                outputs.extend(self.engine.abort_request(command.request_id))
                continue
            error: BaseException | None = None
            try:
                self.engine.add_request(command.prompt, command.params, command.request_id,
                                        priority=command.priority, user=command.user)
            except Exception as e:  # bad input: goes back to the caller, the engine is fine
                error = e
            resolved.append((command.done, error))
        applied_seqs = sum(c.params.n for c in commands if isinstance(c, _Add))
        if applied_seqs:
            # Before answering: back-pressure must count the new requests, once (failed adds
            # leave the unapplied count too).
            self._snapshot(applied_seqs)
        for done, error in resolved:
            self._to_loop(_resolve, done, error)
        return outputs

    def _snapshot(self, applied_seqs: int = 0) -> EngineStats:
        """Publish the engine's stats; `applied_seqs` sequences added since the last one
        are now in them, no longer unapplied."""
        stats = self.engine.stats()
        self.peak_num_running = max(self.peak_num_running, stats.num_requests_running)
        stats = dataclasses.replace(stats, peak_num_requests_running=self.peak_num_running)
        with self._cond:
            self.stats = stats
            self._num_unapplied_seqs -= applied_seqs
        return stats

    def _publish(self, outputs: list[RequestOutput]) -> None:
        stats = self._snapshot()
        if self.listener is not None:
            try:
                self.listener(outputs, stats, time.time())
            except Exception:  # metrics must never take the engine down
                logger.exception("step listener failed")
        if outputs:
            self._to_loop(self._deliver, outputs)

    def _die(self, error: BaseException) -> None:
        self.dead_error = error
        with self._cond:
            commands, self._commands = self._commands, []
        dead = EngineDeadError("the engine failed (the server's log says why)")
        for command in commands:
            if isinstance(command, _Add):
                self._to_loop(_resolve, command.done, dead)
        self._to_loop(self._fail_all, dead)
        if self.on_dead is not None:
            self._to_loop(self.on_dead, error)

    def _to_loop(self, callback: Callable[..., None], *args: Any) -> None:
        if self._loop is None or self._loop.is_closed():
            return
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the event loop closed meanwhile
            pass

    # ------------------------------------------------------------------ the event loop side
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            # "error" with no reason of its own: the engine step failed (an internal error)
            if output.finished and any(c.finish_reason == "error" and c.error is None
                                       for c in output.outputs):
                stream._fail(RequestFailedError(output.request_id))
            else:
                stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._fail(error)
        self._streams.clear()


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
