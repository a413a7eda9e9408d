"""Give back the calling thread's OpenMP worker threads (``omp_pause_resource_all``).

OpenMP keeps a pool of worker threads per thread that has started a parallel region, and
libgomp counts every pool's threads: once they outnumber the cores it stops spin-waiting
between parallel regions, and every kernel call of a decode step then waits for its workers
to wake (one stream: 0.4x on a 2-core machine, docs/benchmarks.md). An engine built in one
thread and stepped in another (the server's loop thread, an application's worker) would
meet that: the thread that loaded the model keeps its pool unless it gives it back, which
this does. OpenMP 5.0's ``omp_pause_resource_all`` frees only the calling thread's pool; the
next parallel region started from that thread makes a new one.
"""

from __future__ import annotations

import ctypes
import functools
import os

OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp5", "libomp")  # GNU, Intel, LLVM


@functools.cache
def _pause() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """``omp_pause_resource_all`` of the OpenMP runtime this process loaded (torch's), or
    None (none loaded, or too old to have it)."""
    try:
        with open(f"/proc/{os.getpid()}/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/" in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        if os.path.basename(path).startswith(_RUNTIMES):
            try:
                return ctypes.CDLL(path).omp_pause_resource_all
            except (OSError, AttributeError):
                continue
    return None


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads; False if there is no runtime to ask
    or it refused (inside a parallel region)."""
    pause = _pause()
    if pause is None:
        return False
    return pause(OMP_PAUSE_SOFT) == 0
