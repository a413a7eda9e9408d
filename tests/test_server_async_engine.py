"""AsyncEngine without a model: a scripted LLMEngine stand-in drives the loop thread.

Covers what the end-to-end tests can't provoke: a step that raises (engine dead, streams
fail, /health 503), validation errors before streaming, idempotent aborts, back-pressure,
and an idle loop that sleeps instead of spinning.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from conveyor.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
)
from conveyor.engine.stats import FINISH_REASONS, EngineStats
from conveyor.outputs import CompletionOutput, RequestMetrics, RequestOutput
from conveyor.sampling_params import RequestOutputKind, SamplingParams


class ScriptedEngine:
    """Each request emits one token per step until max_tokens; `fail_next_step` raises."""

    def __init__(self) -> None:
        self.model_name = "scripted"
        self.model_names = ("scripted",)
        self.tokenizer = None
        self.default_sampling: dict[str, Any] = {}
        self.scheduler_config = SimpleNamespace(max_model_len=128, max_num_seqs=4)
        self.model_config = SimpleNamespace(vocab_size=100)
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.fail_next_step = False
        self.num_steps = 0
        self.num_stats_calls = 0
        self.thread_ids: set[int] = set()
        self.aborted: list[str] = []

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        return None, list(prompt)

    def check_token_ids(self, ids: list[int], field: str) -> None:
        pass

    def stats(self) -> EngineStats:
        self.num_stats_calls += 1
        return EngineStats(
            kv_blocks_total=1, kv_blocks_free=1, kv_cache_usage=0.0, num_preemptions=0,
            num_preempted_tokens=0, num_requests_running=len(self.requests),
            num_requests_waiting=0, num_steps=self.num_steps, num_swapped_blocks=0,
            peak_num_requests_running=0, peak_kv_utilization=0.0, prefix_cache_queries=0,
            prefix_cache_hits=0, num_prompt_tokens=0, num_generation_tokens=0,
            finished_by_reason=dict.fromkeys(FINISH_REASONS, 0))

    def add_request(self, prompt: list[int], params: SamplingParams, request_id: str,
                    priority: int = 0, user: str | None = None) -> str:
        self.thread_ids.add(threading.get_ident())
        if not prompt:
            raise ValueError("prompt must not be empty")
        self.requests[request_id] = (prompt, params, [])
        return request_id

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        if request_id not in self.requests:
            return []
        self.aborted.append(request_id)
        return [self._output(request_id, "abort")]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.num_steps += 1
        if self.fail_next_step:
            raise RuntimeError("boom")
        time.sleep(0.005)
        outputs = []
        for request_id, (_, params, tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            done = len(tokens) >= params.max_tokens
            outputs.append(self._output(request_id, "length" if done else None))
        return outputs

    def _output(self, request_id: str, finish_reason: str | None) -> RequestOutput:
        prompt, _, tokens = self.requests[request_id]
        if finish_reason is not None:
            del self.requests[request_id]
        completion = CompletionOutput(0, "x" * len(tokens), list(tokens), finish_reason)
        return RequestOutput(request_id, None, prompt, [completion], finish_reason is not None,
                             RequestMetrics(arrival_time=time.time()))


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_generate_streams_and_only_the_loop_thread_touches_the_engine():
    async def main() -> None:
        fake = ScriptedEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        engine.start()
        outputs = [o async for o in engine.generate([1, 2], SamplingParams(max_tokens=4), "a")]
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 4
        assert fake.thread_ids == {engine._thread.ident}
        with pytest.raises(ValueError, match="prompt must not be empty"):
            await engine.add_request([], SamplingParams(), "bad")
        await engine.shutdown()

    _run(main())


def test_a_lagging_stream_of_deltas_appends_them_and_keeps_the_engine_outputs_intact():
    """Deltas put while the consumer is away come out as one output (their sum); a
    cumulative stream keeps only the newest. The outputs handed in are not changed."""

    def delta(tokens: list[int], finish: str | None = None) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=0.0, num_generation_tokens=tokens[-1] + 1)
        return RequestOutput("r", None, [1], [CompletionOutput(0, "ab" * len(tokens), tokens,
                                                              finish)],
                             finish is not None, metrics)

    async def main() -> None:
        puts = [delta([0]), delta([1, 2]), delta([3], "length")]
        for kind, want in ((RequestOutputKind.DELTA, [0, 1, 2, 3]),
                           (RequestOutputKind.CUMULATIVE, [3])):
            stream = RequestStream("r", None, kind)  # type: ignore[arg-type]
            for output in puts:
                stream._put(output)
            got = [o async for o in stream]
            assert len(got) == 1 and got[0].finished
            assert got[0].outputs[0].token_ids == want
            assert got[0].outputs[0].text == "ab" * len(want)
            assert got[0].metrics.num_generation_tokens == 4
        assert [o.outputs[0].token_ids for o in puts] == [[0], [1, 2], [3]]

    _run(main())


def test_abort_is_idempotent_and_frees_the_request():
    async def main() -> None:
        fake = ScriptedEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        engine.start()
        stream = await engine.add_request([1], SamplingParams(max_tokens=10_000), "a")
        await stream.__anext__()
        engine.abort("a")
        engine.abort("a")
        engine.abort("never-existed")
        final = [o async for o in stream][-1]
        assert final.outputs[0].finish_reason == "abort"
        assert fake.aborted == ["a"] and not fake.requests
        stream.close()  # after the end: harmless
        await engine.shutdown()

    _run(main())


def test_idle_loop_sleeps():
    async def main() -> None:
        fake = ScriptedEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        engine.start()
        async for _ in engine.generate([1], SamplingParams(max_tokens=2), "a"):
            pass
        await asyncio.sleep(0.05)
        steps, stats_calls = fake.num_steps, fake.num_stats_calls
        await asyncio.sleep(0.3)
        assert (fake.num_steps, fake.num_stats_calls) == (steps, stats_calls)
        await engine.shutdown()

    _run(main())


def test_queue_limit_counts_only_requests_beyond_free_slots():
    """--max-queued-requests bounds the requests that would wait beyond the free sequence
    slots (max_num_seqs 4 here): adds a free slot takes at once never count."""
    async def main() -> None:
        fake = ScriptedEngine()
        engine = AsyncEngine(fake, max_queued_requests=1)  # type: ignore[arg-type]
        engine.start()
        idle = dataclasses.replace(engine.stats, num_requests_running=0)
        engine.stats = dataclasses.replace(idle, num_requests_waiting=4)  # all four take slots
        stream = await engine.add_request([1], SamplingParams(max_tokens=1), "a")
        assert [o.finished async for o in stream] == [True]
        busy = dataclasses.replace(idle, num_requests_running=3, num_requests_waiting=1)
        engine.stats = busy  # one free slot, one waiting for it: the next one would queue
        await (await engine.add_request([1], SamplingParams(max_tokens=1), "b")).__anext__()
        engine.stats = dataclasses.replace(busy, num_requests_waiting=2)  # one queued: full
        with pytest.raises(QueueFullError) as info:
            await engine.add_request([1], SamplingParams(), "c")
        assert info.value.retry_after_s >= 1
        engine.stats = idle
        with pytest.raises(QueueFullError):  # n=6 sequences: 2 beyond the 4 free slots
            await engine.add_request([1], SamplingParams(n=6, seed=0), "d")
        await engine.shutdown()

    _run(main())


def test_failing_step_kills_the_engine_and_its_streams():
    from conveyor.server.app import build_app

    async def main() -> None:
        fake = ScriptedEngine()
        engine = AsyncEngine(fake)  # type: ignore[arg-type]
        app = build_app(engine)
        engine.start()  # what the app's lifespan does
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/health")).status_code == 200
            stream = await engine.add_request([1], SamplingParams(max_tokens=10_000), "a")
            await stream.__anext__()
            fake.fail_next_step = True
            with pytest.raises(EngineDeadError):
                async for _ in stream:
                    pass
            response = await client.get("/health")
            assert response.status_code == 503 and "error" in response.json()
            response = await client.post("/v1/completions", json={"prompt": [1, 2]})
            assert response.status_code == 503
            assert response.json()["error"]["code"] == "engine_dead"
        with pytest.raises(EngineDeadError):
            await engine.add_request([1], SamplingParams(), "b")
        await engine.shutdown()

    _run(main())


def test_a_cancelled_submit_closes_what_it_added() -> None:
    """The server adds a request's prompts at once; cancelled while some adds wait for the
    engine (the client went away), those already added are closed (aborted), not left to
    run. An engine stand-in: the race is the point, not the model."""
    from conveyor.engine.async_engine import RequestStream
    from conveyor.server.common import submit

    closed: list[str] = []

    class Stream(RequestStream):
        def __init__(self, request_id: str) -> None:  # (no engine behind it)
            self.request_id = request_id

        def close(self) -> None:
            closed.append(self.request_id)

    class Engine:
        async def add_request(self, ids, params, request_id, priority, user):
            if ids[0] != 0:
                await asyncio.sleep(10)  # still waiting for the engine's step
            return Stream(request_id)

    async def main() -> None:
        task = asyncio.create_task(submit(SimpleNamespace(engine=Engine()), [[0], [1]],
                                          None, "r", SimpleNamespace(priority=0, user=None)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert [c.split("-")[1] for c in closed] == ["0"]
