"""Prometheus metrics with vLLM's names, types and buckets under the ``conveyor:`` prefix.

A dashboard or router built for vLLM ports by changing the prefix. Every metric is labelled
``model_name`` and lives in a per-app ``CollectorRegistry`` (several servers per process in
tests). ``ServerMetrics.on_step`` runs in the engine's loop thread after every iteration;
prometheus_client is thread-safe, and the per-request state here is touched by that thread only.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from conveyor.engine.stats import FINISH_REASONS, EngineStats
from conveyor.outputs import RequestOutput

PREFIX = "conveyor:"

# vLLM's buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """[1, 2, 5, 10, 20, 50, ...] up to max_value (vLLM's token-count buckets)."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class ServerMetrics:
    """The server's Prometheus metrics; fed from engine outputs and stats snapshots."""

    def __init__(self, model_name: str, max_model_len: int,
                 registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Number of requests in model execution.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.kv_tokens = gauge("kv_cache_capacity_tokens",
                               "KV-cache capacity in tokens (blocks x block size).")
        self.tp_size = gauge("tensor_parallel_size", "Ranks the model is split across.")
        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens",
                                         "Number of generation tokens processed.")
        self.preemptions = counter("num_preemptions", "Cumulative number of preemptions.")
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens.")
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Number of spec decoding drafts (verifies of drafted tokens).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Number of draft tokens.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Number of accepted tokens.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.",
                                             ("position",))
        self._last_per_pos: tuple[int, ...] = ()
        self.success = counter("request_success", "Count of successfully processed requests.",
                               ("finished_reason",))
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = histogram("time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("request_prompt_tokens",
                                    "Number of prefill tokens processed.", token_buckets)
        self.generation_len = histogram("request_generation_tokens",
                                        "Number of generation tokens processed.", token_buckets)
        self._model = model_name
        for reason in FINISH_REASONS:  # export zeros, so a rate() has a starting point
            self.success.labels(model_name, reason)
        for metric in self._counters():
            metric.labels(model_name)
        self._last_counts: tuple[int, ...] = (0,) * 8  # _counts before any step
        # request_id -> (tokens generated so far, time of the last one): loop thread only.
        self._progress: dict[str, tuple[int, float]] = {}

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, now: float) -> None:
        """Update everything from one loop iteration (called in the engine's loop thread)."""
        m = self._model
        self.running.labels(m).set(stats.num_requests_running)
        self.waiting.labels(m).set(stats.num_requests_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        self.kv_tokens.labels(m).set(stats.kv_cache_tokens)
        self.tp_size.labels(m).set(stats.tensor_parallel_size)
        counts = _counts(stats)
        for metric, count, last in zip(self._counters(), counts, self._last_counts,
                                       strict=True):
            if count > last:
                metric.labels(m).inc(count - last)
        self._last_counts = counts
        per_pos = stats.spec_decode_num_accepted_tokens_per_pos
        last_pos = self._last_per_pos or (0,) * len(per_pos)
        for pos, (count, last) in enumerate(zip(per_pos, last_pos, strict=True)):
            if count > last:
                self.spec_accepted_per_pos.labels(m, str(pos)).inc(count - last)
        self._last_per_pos = per_pos
        for output in outputs:
            self._observe(output, now)

    def _counters(self) -> tuple[Counter, ...]:
        """The counters that follow EngineStats' cumulative counts, in _counts' order."""
        return (self.prompt_tokens, self.generation_tokens, self.preemptions,
                self.prefix_queries, self.prefix_hits, self.spec_drafts,
                self.spec_draft_tokens, self.spec_accepted)

    def _observe(self, output: RequestOutput, now: float) -> None:
        m, rid = self._model, output.request_id
        num_tokens = output.metrics.num_generation_tokens  # (outputs may be deltas)
        seen, last_time = self._progress.get(rid, (0, 0.0))
        if num_tokens > seen:
            if seen == 0:
                ttft = output.metrics.time_to_first_token
                if ttft is not None:
                    self.ttft.labels(m).observe(max(ttft, 0.0))
            else:
                self.itl.labels(m).observe(now - last_time)
            self._progress[rid] = (num_tokens, now)
        if output.finished:
            self._progress.pop(rid, None)
            self._observe_finished(output, num_tokens, now)

    def _observe_finished(self, output: RequestOutput, num_tokens: int, now: float) -> None:
        m, times = self._model, output.metrics
        for completion in output.outputs:
            self.success.labels(m, completion.finish_reason or "abort").inc()
        self.e2e.labels(m).observe(max(now - times.arrival_time, 0.0))
        if times.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(max(times.first_scheduled_time
                                                  - times.arrival_time, 0.0))
            self.inference_time.labels(m).observe(max(now - times.first_scheduled_time, 0.0))
        self.prompt_len.labels(m).observe(len(output.prompt_token_ids))
        self.generation_len.labels(m).observe(num_tokens)


def _counts(stats: EngineStats) -> tuple[int, ...]:
    """The cumulative engine counters the Prometheus counters follow."""
    return (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_preemptions,
            stats.prefix_cache_queries, stats.prefix_cache_hits, stats.spec_decode_num_drafts,
            stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens)
