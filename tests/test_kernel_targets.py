"""The C++ kernels compile for every CPU family they have code for, whichever CPU runs the
suite. Each family's code is compiled only where ``-march=native`` enables it, so a change
made on one CPU could break another's build unseen: ae8b11f (on Zen 4) made an AMX tile
number a template argument, which GCC's tile macros paste into the instruction text, and
every AMX Xeon fell back to the torch reference ops for 29 hours. Here each family other than
this CPU's own (its build is the kernels' load) is compiled to an object file (-O0: the
assembler still sees every instruction; the optimizer's time is not needed)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

from conveyor.ops import cpu_kernels

# (-march, the /proc/cpuinfo flag that puts a CPU in this family), widest first: a CPU is in
# the first family whose flag it has.
FAMILIES = [
    ("sapphirerapids", "amx_tile"),  # AMX tiles (quant_linear, prefill attention)
    ("cooperlake", "avx512_bf16"),  # AVX512-BF16 without AMX: the dot kernels (Zen 4's path)
    ("skylake-avx512", "avx512f"),  # AVX-512 without bf16: float32 on 16 lanes
    ("haswell", "avx2"),  # AVX2 and FMA only: float32 on 8 lanes
]


def _native_family() -> str | None:
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return next((march for march, flag in FAMILIES if flag in flags), None)


COMPILE_TIMEOUT_S = 600  # one unit takes ~10 s at -O0 on 2 cores
ERROR_TAIL = 3000  # characters of the compiler's errors in a failure's message


@pytest.mark.parametrize("march", [march for march, _ in FAMILIES])
@pytest.mark.parametrize("source", cpu_kernels._SOURCES, ids=lambda p: p.name)
def test_the_kernels_compile_for_every_cpu_family(march: str, source: Path,
                                                   tmp_path: Path) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the kernels are x86 code (on other CPUs the torch reference ops run)")
    if march == _native_family():
        # Not a skip: this CPU's own build must succeed, and it is the same compiler's work.
        assert cpu_kernels.load_cpu_kernels(), "the kernels must build for this CPU"
        return
    assert shutil.which("g++"), "the kernels need g++ (as their build on this CPU does)"
    from torch.utils import cpp_extension

    includes = [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]
    command = ["g++", "-std=c++20", "-O0", f"-march={march}", "-fopenmp", "-fPIC",
               "-DTORCH_EXTENSION_NAME=conveyor_target_check", "-DTORCH_API_INCLUDE_EXTENSION_H",
               *(arg for path in includes for arg in ("-isystem", path)),
               "-c", str(source), "-o", str(tmp_path / "kernels.o")]
    build = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, f"-march={march}: {build.stderr[-ERROR_TAIL:]}"
