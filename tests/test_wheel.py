"""`pip install .` (a wheel, not an editable install) carries everything its kernels are
compiled from: a wheel missing a header would silently fall back to the slow torch ops. It
carries the web page's files too (`conveyor serve` serves them from the package).

The wheel is built from this checkout and installed into a fresh virtual environment (its
dependencies seen through a path file to this interpreter's site-packages, whose own path
files, such as an editable conveyor's, are not read from there). There the installed package
names its kernel sources, every file they include (recursively) is found beside them, and
the kernels build (into a folder of their own) and load.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import re
from pathlib import Path
import conveyor
from conveyor.ops import cpu_kernels
assert conveyor.__file__.startswith(%r), conveyor.__file__
todo, seen = list(cpu_kernels._SOURCES), set()
while todo:
    path = Path(todo.pop())
    assert path.is_file(), f"the installed package lacks {path}"
    seen.add(path.name)
    for name in re.findall(r'^#include "([^"]+)"', path.read_text(), re.M):
        if name not in seen:
            todo.append(path.parent / name)
print("kernel files", *sorted(seen))
import torch
from conveyor import ops
assert ops.load_cpu_kernels(), "the kernels did not build from the installed package"
assert torch.ops.conveyor.rms_norm is not None
print("loaded from", conveyor.__file__)
"""


def test_a_wheel_install_builds_and_loads_the_kernels(tmp_path) -> None:
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                    str(ROOT)], check=True, timeout=600)
    (wheel,) = dist.glob("conveyor-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    purelib = Path(subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True).stdout.strip())
    outer = {*site.getsitepackages(), sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib / "outer.pth").write_text("\n".join(sorted(outer)) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(purelib), str(wheel)], check=True, timeout=300)
    installed = str(purelib / "conveyor")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CONVEYOR_KERNELS")}
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "extensions")
    result = subprocess.run([python, "-c", CHECK % installed], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded from " + installed in result.stdout
    sources = {p.name for p in (ROOT / "src/conveyor/ops/csrc").iterdir()}
    # Every file of csrc is a source or included by one: what the build reads, installed.
    assert "kernel files " + " ".join(sorted(sources)) in result.stdout, result.stdout
    assert sources == {p.name for p in (purelib / "conveyor/ops/csrc").iterdir()} - {"__pycache__"}
    page = {p.name for p in (ROOT / "src/conveyor/server/static").iterdir()}
    assert page == {p.name for p in (purelib / "conveyor/server/static").iterdir()}
