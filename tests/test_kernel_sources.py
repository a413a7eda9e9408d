"""The C++ kernels compile for every CPU family they have code for, not just this one.

The engine builds them with -march=native, so CI (and every session) compiles only the paths
of the CPU at hand; the others go unchecked until a machine of their family starts, and a
build error there is not an error: the engine logs it and runs the torch reference ops,
several times slower. That happened: `kernels.cpp` compiles the matmul files as one unit,
and where AVX512-BF16 is on, dot_blocks.cpp's and f32_linear.cpp's internals had the same
names, so every Zen 4 and Sapphire Rapids machine lost all its kernels; and again on CPUs with
AVX2 but no AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP), where decode attention's
prefetches named a helper only AVX-512 builds imported. Here both units are compiled (syntax
only) for an AMX CPU (Sapphire Rapids: AMX, AVX512-BF16, VNNI and AVX2 paths at once), an
AVX512-BF16 CPU without AMX (AMD Zen 4's path), an AVX2 CPU (x86-64-v3) and the x86-64
baseline (the scalar loops).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig

import pytest
from torch.utils import cpp_extension

from conveyor.ops import cpu_kernels

TARGETS = {"amx": ["-march=sapphirerapids"], "avx512bf16": ["-march=x86-64-v4", "-mavx512bf16"],
           "avx2": ["-march=x86-64-v3"], "baseline": ["-march=x86-64"]}


def test_the_kernels_compile_for_every_cpu_family() -> None:
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler: the engine runs the torch reference ops")
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(),
                                   sysconfig.get_paths()["include"]]]
    flags = ["-std=c++17", "-fsyntax-only", "-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-DTORCH_EXTENSION_NAME=conveyor_syntax_check", *includes]
    jobs = [(target, source) for target in TARGETS for source in cpu_kernels._SOURCES]
    failures = []
    for i in range(0, len(jobs), 2):  # two at a time: CI has two cores
        running = [(job, subprocess.Popen([compiler, *flags, *TARGETS[job[0]], str(job[1])],
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True)) for job in jobs[i:i + 2]]
        for (target, source), proc in running:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                errors = [line for line in out.splitlines() if "error" in line][:5]
                failures.append(f"{source.name} for {target}: " + "\n".join(errors))
    assert not failures, "\n\n".join(failures)
