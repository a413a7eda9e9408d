"""The kernels as a CPU with AVX2 and no AVX-512 runs them (AMD Zen 2 and 3, Intel before
Skylake-SP): float32 everywhere, 8-lane matmuls and decode attention (docs/benchmarks.md,
"float32 on a CPU with AVX2 only").

CI's machines have AVX-512, and the engine builds its kernels with -march=native, so those
CPUs' code paths would only ever be compiled (tests/test_kernel_sources.py), never run. Here
they are built for x86-64-v3 (AVX2, FMA, F16C: a subset of this CPU's) into a folder of their
own, and the float32 kernel tests and the op tests run against that build in a subprocess,
with the dtype such a CPU gets (float32: no bf16 units).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.model.device import cpu_flags

ROOT = Path(__file__).resolve().parents[1]

RUN = """
import sys
import pytest
import torch
from conveyor.model import device
from conveyor.ops import cpu_kernels
cpu_kernels._CFLAGS = ["-O3", "-march=x86-64-v3", "-fopenmp"]
cpu_kernels._cpu_tag = lambda: "x86-64-v3"
device.cpu_has_fast_bf16 = lambda: False  # such a CPU has no bf16 units
assert cpu_kernels.load_cpu_kernels(), "the x86-64-v3 build failed"
ops = torch.ops.conveyor
assert ops.f32_linear_available() and not ops.dot_linear_available(), "not an AVX2-only build"
sys.exit(pytest.main(["-q", "-n", "0", "-p", "no:cacheprovider", "tests/test_f32_kernels.py",
                      "tests/test_ops.py"]))
"""


def test_an_avx2_only_build_passes_the_kernel_tests(tmp_path) -> None:
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: the engine runs the torch reference ops")
    if not {"avx2", "fma", "f16c"} <= (cpu_flags() or frozenset()):
        pytest.skip("this CPU cannot run an x86-64-v3 build")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", RUN], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1200)
    assert result.returncode == 0, result.stdout[-4000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
