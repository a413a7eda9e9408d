"""The client loop of ``conveyor bench serve``: load against any OpenAI-compatible server.

Requests are sent with streaming on (``stream_options.include_usage``) at Poisson or gamma
arrival times, optionally under a concurrency cap; each stream is timed chunk by chunk.
A request that fails (HTTP error, broken connection, error chunk) becomes a failed record;
it never stops the run. With ``abort_fraction`` the client cancels that share of the streams
(chosen by the seed) after a random number of chunks, as users do, for soaks with aborts.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import httpx
import numpy as np
from tqdm.asyncio import tqdm

from conveyor.bench.datasets import DatasetConfig, SampleRequest, sample_requests
from conveyor.bench.metrics import (
    BenchmarkMetrics,
    RequestRecord,
    compute_metrics,
    metrics_to_dict,
    record_to_dict,
)

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# Per-request timeout: generous, as vLLM's (6 h), since a long run under overload is the
# point of some benchmarks; connection failures still surface at once.
REQUEST_TIMEOUT_S = 6 * 60 * 60
# Longest slice of an error response body kept in a record.
MAX_ERROR_CHARS = 500


@dataclass(frozen=True)
class BenchmarkConfig:
    """Everything a serving benchmark run needs; validated at construction."""

    base_url: str  # server root, e.g. "http://127.0.0.1:8000" (no /v1)
    endpoint: str = "/v1/completions"  # one of ENDPOINTS
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None  # sent as "Authorization: Bearer ..."
    dataset: DatasetConfig = DatasetConfig()
    request_rate: float = math.inf  # mean req/s; inf sends every request at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1.0 = Poisson
    max_concurrency: int | None = None  # most requests in flight; None = unlimited
    seed: int = 0  # arrival times (the dataset has its own seed)
    ignore_eos: bool = False  # send `ignore_eos: true` (vLLM, conveyor, llama.cpp)
    temperature: float = 0.0
    percentiles: tuple[float, ...] = (99.0,)  # latency percentiles to report
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)  # "ttft"/"tpot"/"e2el"
    show_progress: bool = True
    abort_fraction: float = 0.0  # share of streams cancelled mid-stream (seeded), 0..1
    n: int = 1  # choices per request (sampling's n): their tokens all count as output
    # Send each request's response_format (json-schema dataset); False: the same requests
    # unconstrained, the baseline of `--dataset json-schema`
    constrained: bool = True

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {ENDPOINTS}, got {self.endpoint!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.base_url!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"abort_fraction must be in [0, 1], got {self.abort_fraction}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if any(not 0 <= p <= 100 for p in self.percentiles):
            raise ValueError(f"percentiles must be in [0, 100], got {self.percentiles}")
        if self.chat and self.dataset.name == "reference":
            raise ValueError("--dataset reference sends token ids: use /v1/completions")

    @property
    def chat(self) -> bool:
        """Whether requests go to the chat endpoint (messages, delta.content)."""
        return self.endpoint == "/v1/chat/completions"


@dataclass
class BenchmarkResult:
    """A finished run: its settings, its aggregates and every request's record."""

    config: BenchmarkConfig
    model: str
    metrics: BenchmarkMetrics
    records: list[RequestRecord]
    date: str  # local start time, "%Y%m%d-%H%M%S" as vLLM's result files

    @property
    def first_error(self) -> str | None:
        """The error message of the first failed request, if any failed."""
        return next((r.error for r in self.records if r.error is not None), None)

    def to_dict(self) -> dict[str, Any]:
        """The result JSON: vLLM's metric keys, the run's settings and per-request records."""
        cfg = self.config
        return {
            "date": self.date,
            "backend": "openai-chat" if cfg.chat else "openai",
            "base_url": cfg.base_url,
            "endpoint": cfg.endpoint,
            "model_id": self.model,
            "dataset_name": cfg.dataset.name,
            "num_prompts": len(self.records),
            "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            "burstiness": cfg.burstiness,
            "max_concurrency": cfg.max_concurrency,
            "ignore_eos": cfg.ignore_eos,
            "abort_fraction": cfg.abort_fraction,
            "n": cfg.n,
            **metrics_to_dict(self.metrics),
            "first_error": self.first_error,
            "requests": [record_to_dict(r) for r in self.records],
        }


def _headers(config: BenchmarkConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}


async def fetch_model_id(client: httpx.AsyncClient, config: BenchmarkConfig) -> str:
    """The first model id the server lists at GET /v1/models (ValueError if none)."""
    try:
        response = await client.get(f"{config.base_url}/v1/models", headers=_headers(config))
        response.raise_for_status()
        models = response.json().get("data") or []
    except (httpx.HTTPError, ValueError, AttributeError) as e:
        raise ValueError(
            f"could not list models at {config.base_url}/v1/models ({e}); pass --model"
        ) from None
    if not models or "id" not in models[0]:
        raise ValueError(f"{config.base_url}/v1/models lists no model; pass --model")
    return str(models[0]["id"])


def build_payload(config: BenchmarkConfig, model: str, request: SampleRequest) -> dict[str, Any]:
    """The JSON body of one streamed completions or chat-completions request."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.chat:
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if config.ignore_eos:
        payload["ignore_eos"] = True
    if config.n > 1:
        payload["n"] = config.n
    if config.constrained and request.response_format is not None:
        payload["response_format"] = request.response_format
    return payload


def chunk_text(chunk: dict[str, Any], chat: bool) -> str:
    """The generated text one streamed chunk carries, over all its choices ("" for
    role-only or usage chunks). With n > 1 a chunk carries one choice or several."""
    if not chat:
        return "".join(c.get("text") or "" for c in chunk.get("choices") or [])
    # Reasoning models stream their thinking separately; it is generated output all the same.
    return "".join((d.get("content") or "") + (d.get("reasoning_content") or "")
                   for c in chunk.get("choices") or [] if (d := c.get("delta") or {}))


async def _sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The payload of each `data:` line of a server-sent-events stream, up to [DONE]."""
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), `event:` lines
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield data


def abort_points(num_requests: int, fraction: float, output_lens: Sequence[int],
                 seed: int) -> list[int | None]:
    """Per request, the number of content chunks after which the client cancels it (0: as
    soon as the response starts), or None; round(fraction * n) requests, chosen by `seed`."""
    rng = np.random.default_rng([seed, 1])  # apart from the arrival times' stream
    points: list[int | None] = [None] * num_requests
    chosen = rng.choice(num_requests, size=round(fraction * num_requests), replace=False)
    for i in sorted(int(c) for c in chosen):
        points[i] = int(rng.integers(0, max(output_lens[i], 1)))
    return points


async def _read_stream(response: httpx.Response, record: RequestRecord, chat: bool,
                       abort_after: int | None) -> tuple[int, dict[str, Any] | None]:
    """Time the chunks of one SSE stream into `record`: (content chunks, usage). Stops
    reading (the caller then closes the connection) after `abort_after` content chunks."""
    num_content_chunks = 0
    usage: dict[str, Any] | None = None
    last = record.start_time
    record.aborted = abort_after == 0
    if record.aborted:
        return 0, None
    async for data in _sse_data(response):
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(f"error chunk: {json.dumps(chunk['error'])[:MAX_ERROR_CHARS]}")
        now = time.perf_counter()
        if chunk_text(chunk, chat):
            if num_content_chunks == 0:
                record.ttft = now - record.start_time
            else:
                record.itl.append(now - last)
            num_content_chunks += 1
            last = now
        usage = chunk.get("usage") or usage
        if abort_after is not None and num_content_chunks >= abort_after:
            record.aborted = True
            break
    return num_content_chunks, usage


async def send_request(
    client: httpx.AsyncClient, config: BenchmarkConfig, model: str, request: SampleRequest,
    abort_after: int | None = None,
) -> RequestRecord:
    """Send one streamed request and time it; every failure becomes a failed record.
    With `abort_after`, cancel it after that many content chunks (an aborted record)."""
    record = RequestRecord(success=False, prompt_len=request.prompt_len_hint)
    payload = build_payload(config, model, request)
    start = time.perf_counter()
    record.start_time = start
    try:
        url = f"{config.base_url}{config.endpoint}"
        async with client.stream("POST", url, json=payload, headers=_headers(config)) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                raise RuntimeError(f"HTTP {response.status_code}: {body[:MAX_ERROR_CHARS]}")
            num_content_chunks, usage = await _read_stream(response, record, config.chat,
                                                           abort_after)
        record.end_time = time.perf_counter()
        record.latency = record.end_time - start
        if record.aborted:
            return record
        if num_content_chunks == 0:
            raise RuntimeError("the stream carried no generated text (no TTFT to measure)")
        record.output_tokens = int(usage["completion_tokens"]) if usage else num_content_chunks
        if usage and usage.get("prompt_tokens") is not None:
            record.prompt_len = int(usage["prompt_tokens"])
        record.success = True
    except Exception as e:  # one request's failure must not end the run
        record.end_time = record.end_time or time.perf_counter()
        record.success = False
        record.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return record


async def arrivals(
    requests: Sequence[SampleRequest], rate: float, burstiness: float, seed: int
) -> AsyncIterator[SampleRequest]:
    """Yield requests at gamma-distributed intervals (shape = burstiness, mean = 1/rate).

    burstiness 1.0 gives a Poisson process; below 1 is burstier, above 1 more regular.
    An infinite rate yields everything at once.
    """
    rng = np.random.default_rng(seed)
    scale = 1.0 / (rate * burstiness) if math.isfinite(rate) else 0.0
    for i, request in enumerate(requests):
        yield request
        if math.isfinite(rate) and i + 1 < len(requests):
            await asyncio.sleep(float(rng.gamma(shape=burstiness, scale=scale)))


async def run_benchmark(
    config: BenchmarkConfig, requests: Sequence[SampleRequest] | None = None
) -> BenchmarkResult:
    """Run the benchmark `config` describes; `requests` overrides sampling `config.dataset`.

    Raises ValueError when the model can't be resolved (no --model and no /v1/models).
    """
    if requests is None:
        requests = sample_requests(config.dataset)
    limits = httpx.Limits(max_connections=config.max_concurrency, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = config.model or await fetch_model_id(client, config)
        date = datetime.now().strftime("%Y%m%d-%H%M%S")
        semaphore = asyncio.Semaphore(config.max_concurrency or len(requests))
        progress = tqdm(total=len(requests), disable=not config.show_progress, unit="req")

        cancel_after = abort_points(len(requests), config.abort_fraction,
                                    [r.output_len for r in requests], config.seed)
        index = itertools.count()  # arrivals yields the requests in order

        async def limited(request: SampleRequest, abort_after: int | None) -> RequestRecord:
            async with semaphore:
                record = await send_request(client, config, model, request, abort_after)
            progress.update(1)
            return record

        start = time.perf_counter()
        tasks = [
            asyncio.create_task(limited(r, cancel_after[next(index)]))
            async for r in arrivals(requests, config.request_rate, config.burstiness, config.seed)
        ]
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        progress.close()
    metrics = compute_metrics(records, duration, config.percentiles, config.goodput_slos_ms)
    return BenchmarkResult(config, model, metrics, records, date)
