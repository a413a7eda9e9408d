"""The decode hot path's ops: C++ kernels on CPU, the torch reference elsewhere.

``for_device(device)`` returns a namespace with ``rms_norm``, ``add_rms_norm_``,
``silu_mul``, ``rotary_``, ``write_kv_``, ``decode_attention`` and ``argmax`` (signatures in
``reference.py``). On CPU it is ``torch.ops.conveyor``, built from ``csrc/*.cpp`` by
``torch.utils.cpp_extension`` on first use (~25 s with g++ and ninja; cached under
``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``). Each kernel replaces several
torch ops (norm: 8, RoPE: 6, attention: 2 gathers + mask + SDPA) with one call that does no
extra copies; the C++ namespace also has ``decode_layers``, every decoder layer of a
decode-only step in one call (``CausalLM.forward`` uses it when present); for bf16 on CPUs
with AMX (``amx_available``) ``quantized_linear`` (``csrc/quant_linear.cpp``: decode matmuls
that read a GGUF's Q4_0/Q4_1/Q8_0 blocks in place, bit-identical to oneDNN on the bf16
weights); with AVX512-BF16 and no AMX (``dot_kernels_available``) ``dot_linear``, every
matmul at every batch size, on bf16 pair tiles or GGUF blocks (``csrc/dot_linear.cpp``,
``csrc/dot_blocks.cpp``), and for float32 with AVX2 (``f32_kernels_available``) the same on
float32 lane tiles or GGUF blocks (``csrc/f32_linear.cpp``); and ``prefill_attention`` with either
(``csrc/prefill_attention.cpp``). If the build fails (no C++ compiler) the engine logs why
and runs the reference. ``CONVEYOR_KERNELS=0`` selects
the reference on CPU too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from conveyor.ops import reference

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("cpu_ops.cpp", "quant_linear.cpp", "dot_linear.cpp", "dot_blocks.cpp",
                         "f32_linear.cpp", "prefill_attention.cpp")]
# -fopenmp: at::parallel_for is inlined from ATen headers and runs serially without it.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
# A load that took longer than this built (or rebuilt) the kernels: say when they are ready.
_REPORTED_BUILD_S = 2.0


def _cpu_tag() -> str:
    """Kernels are compiled for this CPU (-march=native): key the build by its features."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@functools.cache
def load_cpu_kernels() -> bool:
    """Build (once per machine) and load the C++ kernels; False, with a warning, if that
    fails."""
    if os.environ.get("CONVEYOR_KERNELS", "1") == "0":
        return False
    from torch.utils import cpp_extension

    name = f"conveyor_cpu_ops_{_cpu_tag()}"
    try:
        build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
        with _build_lock(build_dir):
            if not any(build_dir.glob(f"{name}*.so")):
                logger.info("building the C++ kernels for this CPU in %s (first start: ~25 s "
                            "on 2 cores, then cached)", build_dir)
            start = time.perf_counter()
            cpp_extension.load(name=name, sources=[str(p) for p in _SOURCES],
                               extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                               is_python_module=False, verbose=False)
            if time.perf_counter() - start > _REPORTED_BUILD_S:
                logger.info("C++ kernels ready in %.0f s", time.perf_counter() - start)
    except Exception as exc:  # no compiler, no ninja, a build error: run the reference
        logger.warning("C++ kernels unavailable, using the torch reference ops: %s", exc)
        return False
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build folder while building or loading the kernels.

    torch guards a build with a plain ``lock`` file that its builder deletes when done; a
    build killed midway leaves it behind, and every later start then waits for it forever.
    The flock is released by the kernel when its holder dies, so whoever holds it knows that
    no other conveyor process is building here: a ``lock`` file found then is stale.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "conveyor.flock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building the C++ kernels in %s", build_dir)
            fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a kernel build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels (``quantized_linear``, ``prefill_attention``) can run: the C++
    kernels are built, with AMX-BF16, and the OS grants the tile registers."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.amx_available())


@functools.cache
def prefill_attention_available() -> bool:
    """Whether ``prefill_attention`` can run: the C++ kernels are built with AVX512-BF16 (it
    uses AMX tiles where the CPU grants them)."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.prefill_attention_available())


@functools.cache
def dot_kernels_available() -> bool:
    """Whether bf16 matmuls take the AVX512-BF16 dot kernels (``dot_linear``, one kernel for
    every batch size): the C++ kernels are built with AVX512-BF16 and the CPU has no AMX,
    whose own kernels (``quantized_linear`` beside oneDNN) run instead."""
    return (load_cpu_kernels() and bool(torch.ops.conveyor.dot_linear_available())
            and not amx_available())


@functools.cache
def f32_kernels_available() -> bool:
    """Whether float32 matmuls take the AVX2 dot kernels (``dot_linear`` on float32: one
    kernel for every batch size; ``csrc/f32_linear.cpp``): the C++ kernels are built with AVX2
    and FMA. Every CPU that runs float32 by default (no bf16 matrix units) has them."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.f32_linear_available())


def for_device(device: torch.device) -> ModuleType | Any:
    """The ops for tensors on ``device``."""
    if device.type == "cpu" and load_cpu_kernels():
        return torch.ops.conveyor
    return reference
