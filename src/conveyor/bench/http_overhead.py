"""`conveyor bench http`: what the HTTP server costs, measured in one run.

The reference workload (`bench offline`) runs twice on the same engine arguments: through
`LLM.generate`, then through a `conveyor serve` subprocess on a free loopback port, sent all
at once with streaming (`bench serve --dataset reference`). Printed: both throughputs and
their ratio, and the offline mean step time beside the online inter-token latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

from conveyor.bench.datasets import DatasetConfig, workload_requests
from conveyor.bench.offline import Workload, run_workload
from conveyor.bench.serve import BenchmarkConfig, run_benchmark
from conveyor.bench.workloads import warm_up
from conveyor.config import EngineArgs
from conveyor.engine.llm import LLM

SERVER_START_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_flags(args: EngineArgs) -> list[str]:
    """EngineArgs as `conveyor serve` flags (only the ones that differ from the defaults)."""
    flags: list[str] = []
    defaults = EngineArgs()
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + f.name.replace("_", "-"))
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def _wait_healthy(proc: subprocess.Popen[bytes], url: str) -> None:
    deadline = time.monotonic() + SERVER_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"conveyor serve exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("conveyor serve did not become healthy in time")


@contextlib.contextmanager
def serve_subprocess(args: EngineArgs, *flags: str,
                     log_level: str | None = "WARNING") -> Iterator[str]:
    """`conveyor serve` with `args` (and extra serve `flags`) on a free loopback port, its
    output in a temporary file; yields its URL once healthy, stops it on exit.
    `log_level` None: the server's default logging, as a plain `conveyor serve`."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    level = ["--log-level", log_level] if log_level else []
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "conveyor.cli", *level, "serve",
                                 "--port", str(port), *flags, *_engine_flags(args)],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            _wait_healthy(proc, url)
            yield url
        finally:
            proc.terminate()
            proc.wait(60)


def run_http_overhead(args: EngineArgs, workload: Workload) -> dict[str, Any]:
    # Both runs use the same token budget: the server's default unless one is given.
    args = args.for_server()
    llm = LLM.from_engine_args(args)
    warm_up(llm)
    offline = run_workload(llm, workload)
    vocab_size = llm.engine.model_config.vocab_size
    del llm
    gc.collect()

    with serve_subprocess(args) as url:
        dataset = DatasetConfig(name="reference", num_prompts=workload.num_requests,
                                seed=workload.seed)
        config = BenchmarkConfig(base_url=url, dataset=dataset, ignore_eos=True,
                                 show_progress=False)
        online = asyncio.run(run_benchmark(config, workload_requests(workload, vocab_size)))
    m = online.metrics
    return {
        "offline_output_tokens_per_s": offline.output_tokens_per_s,
        "http_output_tokens_per_s": m.output_throughput,
        "http_over_offline": m.output_throughput / offline.output_tokens_per_s,
        "offline_mean_step_ms": 1e3 * offline.duration_s / offline.num_steps,
        "http_mean_itl_ms": m.itl.mean_ms, "http_median_itl_ms": m.itl.median_ms,
        "http_mean_tpot_ms": m.tpot.mean_ms, "http_mean_ttft_ms": m.ttft.mean_ms,
        "offline_output_tokens": offline.output_tokens,
        "http_output_tokens": m.total_output_tokens,
        "http_failed": m.failed, "offline_duration_s": offline.duration_s,
        "http_duration_s": m.duration_s,
    }


def format_http_overhead(r: dict[str, Any]) -> str:
    rows = [("Offline output throughput (tok/s):", r["offline_output_tokens_per_s"]),
            ("HTTP output throughput (tok/s):", r["http_output_tokens_per_s"]),
            ("HTTP / offline:", r["http_over_offline"]),
            ("Offline mean step (ms):", r["offline_mean_step_ms"]),
            ("HTTP mean / median ITL (ms):",
             f"{r['http_mean_itl_ms']:.1f} / {r['http_median_itl_ms']:.1f}"),
            ("HTTP mean TPOT (ms):", r["http_mean_tpot_ms"]),
            ("HTTP failed requests:", r["http_failed"])]
    lines = [" HTTP vs offline ".center(50, "=")]
    lines += [f"{label:<40}{value:.2f}" if isinstance(value, float) else f"{label:<40}{value}"
              for label, value in rows]
    lines.append("=" * 50)
    return "\n".join(lines)
