"""The kernels' build lock: an interrupted build's leftover ``lock`` file no longer makes every later load wait
forever (torch's FileBaton polls for it to go away), and two builders of one directory still take turns."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest

from torch_engine.kernels import exclusive_build


def test_a_lock_left_by_an_interrupted_build_is_removed(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "lock").touch()  # what torch's FileBaton leaves when its build is killed
    with caplog.at_level(logging.WARNING, logger="torch_engine.kernels"), exclusive_build(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert "interrupted kernel build" in caplog.text


def test_a_second_builder_waits_for_the_first_and_goes_on_when_it_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from torch_engine.kernels import "
         "exclusive_build\nwith exclusive_build(Path(sys.argv[1])):\n    print('held', flush=True); time.sleep(60)",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        (tmp_path / "lock").touch()  # the holder's build in progress: torch's lock is live, not stale
        waiter = subprocess.Popen(
            [sys.executable, "-c", "import sys; from pathlib import Path; from torch_engine.kernels import "
             "exclusive_build\nprint('trying', flush=True)\nwith exclusive_build(Path(sys.argv[1])):\n"
             "    print('got it', flush=True)", str(tmp_path)],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent,
        )  # fmt: skip
        try:
            assert waiter.stdout is not None and waiter.stdout.readline().strip() == "trying"
            time.sleep(2)
            assert waiter.poll() is None, "the second builder did not wait for the first"
            assert (tmp_path / "lock").exists(), "a live build's lock was removed"
            holder.kill()  # dies mid-build: the kernel drops its flock, its torch lock stays behind
            out, _ = waiter.communicate(timeout=60)
            assert out.strip() == "got it"
            assert not (tmp_path / "lock").exists()
        finally:
            waiter.kill()
    finally:
        holder.kill()
        holder.wait()
