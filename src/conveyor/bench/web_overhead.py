"""`conveyor bench web`: what an open web page costs the engine, measured in one run.

One `conveyor serve` subprocess; the skewed workload (greedy, ignore_eos: the same tokens
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
import subprocess
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from conveyor.bench.datasets import DatasetConfig, sample_requests
from conveyor.bench.http_overhead import _engine_flags, _free_port, _wait_healthy
from conveyor.bench.serve import BenchmarkConfig, run_benchmark
from conveyor.config import EngineArgs

WATCHERS = ("events", "page")
# The workload once before the timed runs: thread pools, allocator, kernel first calls.
WARM_UP_REQUESTS = 4


@dataclass(frozen=True)
class WebOverheadConfig:
    """What `bench web` runs; validated at construction."""

    num_requests: int = 32  # requests of the skewed workload per run
    rounds: int = 3  # pairs of runs (watched, unwatched)
    watcher: str = "events"  # one of WATCHERS
    workload_seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {self.rounds}")
        if self.watcher not in WATCHERS:
            raise ValueError(f"watcher must be one of {WATCHERS}, got {self.watcher!r}")


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


def run_web_overhead(args: EngineArgs, config: WebOverheadConfig) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", "--log-level", "WARNING",
                                 "serve", "--port", str(port), "--disable-log-requests",
                                 *_engine_flags(args)], stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url)
            pairs = asyncio.run(_rounds(url, config))
        finally:
            proc.terminate()
            proc.wait(60)
    ratios = [w / u for w, u in pairs]
    return {"watcher": config.watcher, "num_requests": config.num_requests,
            "watched_output_tokens_per_s": [w for w, _ in pairs],
            "unwatched_output_tokens_per_s": [u for _, u in pairs],
            "ratios": ratios, "median_ratio": statistics.median(ratios)}


def format_web_overhead(r: dict[str, Any]) -> str:
    lines = [f" web page open ({r['watcher']}) vs not ".center(60, "=")]
    lines.append(f"{'round':<8}{'watched tok/s':>16}{'unwatched tok/s':>18}{'ratio':>10}")
    for i, (w, u, q) in enumerate(zip(r["watched_output_tokens_per_s"],
                                      r["unwatched_output_tokens_per_s"], r["ratios"],
                                      strict=True)):
        lines.append(f"{i:<8}{w:>16.1f}{u:>18.1f}{q:>10.3f}")
    lines.append(f"{'median watched / unwatched:':<42}{r['median_ratio']:>10.3f}")
    lines.append("=" * 60)
    return "\n".join(lines)
