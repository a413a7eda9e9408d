"""The C++ kernels compile for every CPU family they have code for, not just this one.

The engine builds them with -march=native, so CI (and every session) compiles only the paths
of the CPU at hand; the others go unchecked until a machine of their family starts, and a
build error there is not an error: the engine logs it and runs the torch reference ops,
several times slower. That happened three times: `kernels.cpp` compiles the matmul files as
one unit, and where AVX512-BF16 is on, dot_blocks.cpp's and f32_linear.cpp's internals had
the same names, so every Zen 4 and Sapphire Rapids machine lost all its kernels; on CPUs with
AVX2 but no AVX-512 (AMD Zen 2 and 3, Intel before Skylake-SP) decode attention's prefetches
named a helper only AVX-512 builds imported; and ae8b11f (made on Zen 4) gave an AMX tile
number as a template argument, which GCC's tile macros paste into the instruction text: it
passed a syntax-only compile and failed in the assembler, so every AMX Xeon lost its kernels
for 29 hours. Here both units are compiled to object files (-O0: the assembler sees every
instruction; the optimizer's time is not needed) with the build's C++ standard, for an AMX CPU
(Sapphire Rapids: AMX, AVX512-BF16, VNNI and AVX2 paths at once), an AVX512-BF16 CPU without
AMX (Cooper Lake: Zen 4's path), AVX-512 without bf16 (Skylake-SP: float32 on 16 lanes), an
AVX2 CPU (x86-64-v3) and the x86-64 baseline (the scalar loops).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest
from torch.utils import cpp_extension

from conveyor.ops import cpu_kernels

TARGETS = {"amx": "sapphirerapids", "avx512bf16": "cooperlake", "avx512": "skylake-avx512",
           "avx2": "x86-64-v3", "baseline": "x86-64"}
COMPILE_TIMEOUT_S = 600  # one unit takes ~10 s at -O0 on 2 cores
ERROR_LINES = 5  # of the compiler's or assembler's, per failure


def test_the_kernels_compile_for_every_cpu_family(tmp_path: Path) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernels are x86 code (on other CPUs the torch reference ops run)")
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip("no C++ compiler: the engine runs the torch reference ops")
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(),
                                   sysconfig.get_paths()["include"]]]
    flags = ["-std=c++20", "-O0", "-c", "-fPIC", "-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H",
             "-DTORCH_EXTENSION_NAME=conveyor_target_check", *includes]
    jobs = [(target, source) for target in TARGETS for source in cpu_kernels._SOURCES]
    failures = []
    for i in range(0, len(jobs), 2):  # two at a time: CI has two cores
        running = [(job, subprocess.Popen(
            [compiler, *flags, f"-march={TARGETS[job[0]]}", str(job[1]),
             "-o", str(tmp_path / f"{job[0]}-{job[1].stem}.o")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)) for job in jobs[i:i + 2]]
        for (target, source), proc in running:
            out, _ = proc.communicate(timeout=COMPILE_TIMEOUT_S)
            if proc.returncode != 0:
                errors = [line for line in out.splitlines() if "rror" in line][:ERROR_LINES]
                failures.append(f"{source.name} for {target}: " + "\n".join(errors))
    assert not failures, "\n\n".join(failures)
