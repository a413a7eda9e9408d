"""The kernel build's lock (conveyor.ops.cpu_kernels._build_lock): torch's `lock` file, left
behind by a build killed midway, would make every later start wait forever; the flock
conveyor holds around the build tells a stale one from a live build's."""

from __future__ import annotations

import fcntl
import logging
from pathlib import Path

import pytest

from conveyor.ops.cpu_kernels import _build_lock


def test_a_lock_file_left_by_a_killed_build_is_removed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "lock").write_text("")  # what torch's FileBaton leaves when its process dies
    with caplog.at_level(logging.WARNING), _build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        # While held, another process's attempt fails (it logs and waits instead of
        # removing the lock file of a build still running).
        with open(tmp_path / "conveyor.flock") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
    assert "left by a kernel build that was killed" in caplog.text
    with open(tmp_path / "conveyor.flock") as other:  # released on exit
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
