"""``--device this``: measure this machine's memory, memory bandwidth and bf16 matmul speed.

Two short torch benchmarks, about half a second each (``TIME_BUDGET_S``): a large tensor
copy (bandwidth) and a square bf16 matmul (compute). Both report the best of several runs,
since the machine may be shared and the best run is the closest to what the hardware can
do.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from conveyor.planner.plan import DeviceSpec

COPY_BYTES = 128 * 2**20  # per buffer: well past any CPU cache, cheap to allocate
MATMUL_SIZE = 1024  # n for an n x n x n bf16 matmul: 2 * n**3 FLOPs
TIME_BUDGET_S = 0.5  # per benchmark; with torch import the whole stays under ~3 s


def total_memory_bytes() -> int:
    """Physical RAM in bytes, from sysconf or /proc/meminfo."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the file says kB and means KiB
    raise RuntimeError("cannot read this machine's memory size")


def _best_time(fn: Callable[[], object], budget_s: float, device: str = "cpu") -> float:
    """Best wall time of ``fn`` within ``budget_s`` (synchronizing a CUDA device)."""
    import torch

    def run() -> None:
        fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    run()  # warm-up: page faults, thread pool start, kernel selection
    best = float("inf")
    deadline = time.perf_counter() + budget_s
    while True:
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
        if time.perf_counter() > deadline:
            return best


def memory_bandwidth_bytes_per_s(budget_s: float = TIME_BUDGET_S, device: str = "cpu") -> float:
    """Copy bandwidth: bytes read plus bytes written per second by a large tensor copy."""
    import torch

    src = torch.ones(COPY_BYTES // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = _best_time(lambda: dst.copy_(src), budget_s, device)
    return 2 * COPY_BYTES / seconds


def matmul_flops_per_s(budget_s: float = TIME_BUDGET_S, device: str = "cpu",
                       dtype: str = "bfloat16") -> float:
    """Matmul throughput of an n x n by n x n product in ``dtype``, FLOP/s."""
    import torch

    n = MATMUL_SIZE
    a = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=device).to(getattr(torch, dtype))
    seconds = _best_time(lambda: a @ b, budget_s, device)
    return 2 * n**3 / seconds


def measure_this_machine() -> DeviceSpec:
    """A ``DeviceSpec`` for this machine, measured (takes about two seconds)."""
    return DeviceSpec(name="this machine (measured)", memory_bytes=float(total_memory_bytes()),
                      bandwidth_bytes_per_s=memory_bandwidth_bytes_per_s(),
                      flops_per_s=matmul_flops_per_s())
