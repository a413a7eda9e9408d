"""`conveyor bench web`: what an open web page costs the engine, measured in one run.

`--mode cost` (the default; robust on a shared, noisy machine): the head-of-line workload
through `LLM.generate`, with the live view's listener recording every step as if a page
were open, and a thread publishing events every 0.2 s as the server's event loop does.
Printed: the time spent in the listener (in the loop thread) and in publishing (holding the
GIL beside it), as shares of the run's wall time: together, an upper bound on the
throughput an open page takes, from one run; and the time spent building the step traces,
which the web UI costs with no page open too.

`--mode ab`: one `conveyor serve` subprocess; the skewed workload (greedy, ignore_eos: the same tokens
every run) is sent at once, `rounds` times with the live view's stream open and `rounds`
times without, alternating (and alternating which goes first), so that a machine whose
speed drifts (shared, throttled) weighs on both alike. The watcher is either a client that
reads and parses `GET /v1/engine/events` as the page does (`events`), or the page itself
in headless chromium, drawing on the same machine (`page`, needs Playwright and Debian's
chromium). Printed: the output throughput of each run, each round's ratio (watched over
unwatched) and their median.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from conveyor.bench.datasets import DatasetConfig, sample_requests
from conveyor.bench.serve import BenchmarkConfig, run_benchmark
from conveyor.config import EngineArgs

WATCHERS = ("events", "page")
MODES = ("cost", "ab")
# The workload once before the timed runs: thread pools, allocator, kernel first calls.
WARM_UP_REQUESTS = 4


@dataclass(frozen=True)
class WebOverheadConfig:
    """What `bench web` runs; validated at construction."""

    num_requests: int = 32  # requests per run (cost: the head-of-line mix; ab: skewed)
    rounds: int = 3  # pairs of runs (watched, unwatched)
    watcher: str = "events"  # one of WATCHERS
    workload_seed: int = 0
    mode: str = "cost"  # one of MODES
    long_output: int = 128  # cost: output tokens of the head-of-line mix's long requests

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.watcher not in WATCHERS:
            raise ValueError(f"watcher must be one of {WATCHERS}, got {self.watcher!r}")
        if self.long_output < 1:
            raise ValueError(f"long_output must be >= 1, got {self.long_output}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")


@contextlib.asynccontextmanager
async def _events_reader(url: str) -> AsyncIterator[list[int]]:
    """Reads and parses the events stream in a task while open; yields [events read]."""
    count = [0]

    async def read() -> None:
        async with httpx.AsyncClient(timeout=None) as client, client.stream(
                "GET", url + "/v1/engine/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("data:"):
                    json.loads(line[5:])
                    count[0] += 1

    task = asyncio.create_task(read())
    try:
        yield count
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@contextlib.contextmanager
def _page(url: str) -> Iterator[None]:
    """The web page open in headless chromium (in a thread: Playwright's sync API)."""
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium")
    if chromium is None:
        raise RuntimeError("--watcher page needs Debian's chromium (apt-get install chromium)")
    opened, done = threading.Event(), threading.Event()

    def run() -> None:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url + "/")
            page.wait_for_function("() => document.getElementById('live-status')"
                                   ".textContent === '(live)'")
            opened.set()
            done.wait()
            browser.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    if not opened.wait(120):
        raise RuntimeError("the page did not open")
    try:
        yield
    finally:
        done.set()
        thread.join(60)


async def _one_run(url: str, config: WebOverheadConfig, watched: bool, num: int) -> float:
    dataset = DatasetConfig(name="skewed", num_prompts=num, seed=config.workload_seed)
    bench = BenchmarkConfig(base_url=url, dataset=dataset, ignore_eos=True,
                            show_progress=False)
    if watched and config.watcher == "events":
        async with _events_reader(url) as count:
            result = await run_benchmark(bench, sample_requests(dataset))
        if not count[0]:
            raise RuntimeError("the events stream delivered nothing during the run")
    elif watched:
        with _page(url):
            result = await run_benchmark(bench, sample_requests(dataset))
    else:
        result = await run_benchmark(bench, sample_requests(dataset))
    if result.metrics.failed:
        raise RuntimeError(f"{result.metrics.failed} requests failed: {result.first_error}")
    return result.metrics.output_throughput


async def _rounds(url: str, config: WebOverheadConfig) -> list[tuple[float, float]]:
    """(watched, unwatched) output tok/s per round."""
    await _one_run(url, config, False, WARM_UP_REQUESTS)
    pairs = []
    for i in range(config.rounds):
        order = (True, False) if i % 2 == 0 else (False, True)
        tps = {w: await _one_run(url, config, w, config.num_requests) for w in order}
        pairs.append((tps[True], tps[False]))
    return pairs


class _Timed:
    """Seconds spent in a callable, summed over its calls."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args: Any) -> Any:
        start = time.perf_counter()
        result = self.fn(*args)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return result


def run_web_cost(args: EngineArgs, config: WebOverheadConfig) -> dict[str, Any]:
    """The live view's cost inside one offline run (see the module docstring)."""
    from conveyor.bench.workloads import HeadOfLineWorkload, build_llm, warm_up
    from conveyor.engine.async_engine import AsyncEngine
    from conveyor.server.events import PUBLISH_INTERVAL_S, EngineEvents

    llm = build_llm(args)
    warm_up(llm)
    events = EngineEvents(AsyncEngine(llm.engine))
    events._num_subscribers = 1  # as if one page were open: every step is recorded
    on_trace, on_step, publish = (_Timed(events.on_trace), _Timed(events.on_step),
                                  _Timed(events.publish))
    llm.engine.trace_listener = on_trace
    # Building each step's StepTrace: paid whenever the web UI is on, page open or not.
    trace_step = _Timed(llm.engine._trace_step)
    llm.engine._trace_step = trace_step  # type: ignore[method-assign, assignment]
    requests = HeadOfLineWorkload(num_requests=config.num_requests, seed=config.workload_seed,
                                  long_output=config.long_output).requests(
        llm.engine.model_config.vocab_size)
    stop = threading.Event()

    def publisher() -> None:
        while not stop.wait(PUBLISH_INTERVAL_S):
            publish()

    thread = threading.Thread(target=publisher, daemon=True)
    start = time.perf_counter()
    thread.start()
    outputs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                           [s for _, s in requests])
    wall = time.perf_counter() - start
    stop.set()
    thread.join()
    for output in outputs:  # the latencies' share, as the AsyncEngine listener would see them
        on_step([output], llm.stats(), time.time())
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"mode": "cost", "num_requests": config.num_requests, "wall_s": wall,
            "steps": on_trace.calls, "output_tokens_per_s": tokens / wall,
            "listener_s": on_trace.seconds + on_step.seconds, "publishes": publish.calls,
            "publish_s": publish.seconds, "trace_s": trace_step.seconds,
            "trace_share": trace_step.seconds / wall,
            "listener_share": (on_trace.seconds + on_step.seconds) / wall,
            "publish_share": publish.seconds / wall,
            "total_share": (on_trace.seconds + on_step.seconds + publish.seconds) / wall}


def run_web_overhead(args: EngineArgs, config: WebOverheadConfig) -> dict[str, Any]:
    from conveyor.bench.http_overhead import serve_subprocess  # imports torch: not at parse

    if config.mode == "cost":
        return run_web_cost(args, config)
    with serve_subprocess(args, "--disable-log-requests") as url:
        pairs = asyncio.run(_rounds(url, config))
    ratios = [w / u for w, u in pairs]
    return {"mode": "ab", "watcher": config.watcher, "num_requests": config.num_requests,
            "watched_output_tokens_per_s": [w for w, _ in pairs],
            "unwatched_output_tokens_per_s": [u for _, u in pairs],
            "ratios": ratios, "median_ratio": statistics.median(ratios)}


def format_web_overhead(r: dict[str, Any]) -> str:
    if r["mode"] == "cost":
        return "\n".join([
            " the live view's cost, one page open ".center(60, "="),
            f"{'steps, wall time:':<42}{r['steps']:>8}{r['wall_s']:>9.1f} s",
            f"{'output throughput (tok/s):':<42}{r['output_tokens_per_s']:>17.1f}",
            f"{'building step traces (web UI on):':<42}{100 * r['trace_share']:>15.3f} %",
            f"{'in the listeners (loop thread):':<42}{100 * r['listener_share']:>15.3f} %",
            f"{'publishing (' + str(r['publishes']) + ' events):':<42}"
            f"{100 * r['publish_share']:>15.3f} %",
            f"{'together (an upper bound on the cost):':<42}{100 * r['total_share']:>15.3f} %",
            "=" * 60])
    lines = [f" web page open ({r['watcher']}) vs not ".center(60, "=")]
    lines.append(f"{'round':<8}{'watched tok/s':>16}{'unwatched tok/s':>18}{'ratio':>10}")
    for i, (w, u, q) in enumerate(zip(r["watched_output_tokens_per_s"],
                                      r["unwatched_output_tokens_per_s"], r["ratios"],
                                      strict=True)):
        lines.append(f"{i:<8}{w:>16.1f}{u:>18.1f}{q:>10.3f}")
    lines.append(f"{'median watched / unwatched:':<42}{r['median_ratio']:>10.3f}")
    lines.append("=" * 60)
    return "\n".join(lines)
