"""The decode hot path's ops: C++ kernels on CPU, the torch reference elsewhere.

``for_device(device)`` returns a namespace with ``rms_norm``, ``add_rms_norm_``,
``silu_mul``, ``rotary_``, ``write_kv_``, ``decode_attention`` and ``argmax`` (signatures in
``reference.py``). On CPU it is ``torch.ops.conveyor``, built from ``csrc/*.cpp`` by
``torch.utils.cpp_extension`` on first use (~25 s with g++ and ninja; cached under
``~/.cache/torch_extensions``, or ``$TORCH_EXTENSIONS_DIR``). Each kernel replaces several
torch ops (norm: 8, RoPE: 6, attention: 2 gathers + mask + SDPA) with one call that does no
extra copies; the C++ namespace also has ``decode_layers``, every decoder layer of a
decode-only step in one call (``CausalLM.forward`` uses it when present), and two AMX-tile
kernels for bf16 on CPUs that have them (``amx_available``): ``quantized_linear``
(``csrc/quant_linear.cpp``: decode matmuls that read a GGUF's Q4_0/Q4_1/Q8_0 blocks in place,
bit-identical to oneDNN on the bf16 weights) and ``prefill_attention``
(``csrc/prefill_attention.cpp``). If the build fails (no C++ compiler) the engine logs why
and runs the reference. ``CONVEYOR_KERNELS=0`` selects
the reference on CPU too.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from conveyor.ops import reference

logger = logging.getLogger(__name__)

_SOURCES = [Path(__file__).parent / "csrc" / name
            for name in ("cpu_ops.cpp", "quant_linear.cpp", "prefill_attention.cpp")]
# -fopenmp: at::parallel_for is inlined from ATen headers and runs serially without it.
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


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

    try:
        cpp_extension.load(name=f"conveyor_cpu_ops_{_cpu_tag()}", sources=[str(p) for p in _SOURCES],
                           extra_cflags=_CFLAGS, extra_ldflags=["-fopenmp"],
                           is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a build error: run the reference
        logger.warning("C++ kernels unavailable, using the torch reference ops: %s", exc)
        return False
    return True


@functools.cache
def amx_available() -> bool:
    """Whether the AMX kernels (``quantized_linear``, ``prefill_attention``) can run: the C++
    kernels are built, with AMX-BF16, and the OS grants the tile registers."""
    return load_cpu_kernels() and bool(torch.ops.conveyor.amx_available())


def for_device(device: torch.device) -> ModuleType | Any:
    """The ops for tensors on ``device``."""
    if device.type == "cpu" and load_cpu_kernels():
        return torch.ops.conveyor
    return reference
