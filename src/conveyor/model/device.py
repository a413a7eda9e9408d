"""Device and dtype choice: bfloat16 where the hardware runs it fast, float32 otherwise."""

from __future__ import annotations

import functools
import logging
import platform
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# bf16 is chosen on CPU when its matmuls beat float32 by at least this factor (CPUs with
# AVX512-BF16 or AMX run about 4x; without them bf16 is emulated and slower than float32).
BF16_MIN_SPEEDUP = 1.5
_PROBE_SHAPE = (64, 1024)  # a decode-like linear layer: [batch, hidden] x [hidden, 2*hidden]
_PROBE_ROUNDS = 6

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


# CPU flags of bf16 matrix units (x86: AVX512-BF16 dot products, AMX tiles).
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str] | None:
    """The CPU's feature flags as the OS lists them (/proc/cpuinfo), or None where it does not."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f
                          if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else frozenset(flags)


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """True when the CPU has bf16 matrix units: read from the CPU flags where the OS lists
    them (deterministic), measured otherwise (the measured ratio is logged at debug level)."""
    flags = cpu_flags()
    if flags is not None:
        return any(flag in flags for flag in _BF16_CPU_FLAGS)
    return cpu_bf16_speedup() >= BF16_MIN_SPEEDUP


@functools.cache
def cpu_bf16_speedup() -> float:
    """Measured float32 / bfloat16 time of a decode-like linear layer on this CPU (~50 ms).

    Best of several interleaved rounds, so a busy neighbour core does not decide the dtype.
    """
    hidden = _PROBE_SHAPE[1]
    inputs = {dt: (torch.randn(*_PROBE_SHAPE).to(dt), torch.randn(2 * hidden, hidden).to(dt))
              for dt in (torch.float32, torch.bfloat16)}
    best = dict.fromkeys(inputs, float("inf"))
    for _ in range(_PROBE_ROUNDS):
        for dtype, (x, w) in inputs.items():
            start = time.perf_counter()
            for _ in range(5):
                F.linear(x, w)
            best[dtype] = min(best[dtype], time.perf_counter() - start)
    speedup = best[torch.float32] / best[torch.bfloat16]
    logger.debug("CPU bf16 matmul speedup over float32: %.1fx", speedup)
    return speedup


# The CPU flags that decide which kernels run, widest first: a result names them beside its
# CPU (docs/benchmarks.md's rule), since the figures differ by whole factors between them.
KERNEL_CPU_FLAGS = ("amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx2")


def machine_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model name and which of ``KERNEL_CPU_FLAGS`` it has (e.g.
    "Intel(R) Xeon(R) Processor (amx_tile avx512_bf16 avx512_vnni avx512f avx2)")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    flags = cpu_flags() or frozenset()
    return f"{name} ({' '.join(flag for flag in KERNEL_CPU_FLAGS if flag in flags) or 'none'})"
