"""No helper process outlives the process that started it (`mmpack.packing.processes.exit_with_parent`), and
the test run sees every process it leaves behind (`tests.support.leftovers`, the session-finish check).

Each case is a small Python process that forks one helper; the test kills the starter (SIGKILL, nothing
runs in it after) and times the helper's end. The control, a helper that does not call `exit_with_parent`,
lives on (and is stopped by the test).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.support import leftovers
from tests.support.ranks import REPO

STARTER = textwrap.dedent(
    """\
    import multiprocessing as mp, os, sys, time
    from mmpack.packing.processes import exit_with_parent

    def helper(mode, watched):
        if mode == "parent":
            exit_with_parent()
        elif mode == "watched":
            exit_with_parent(watched, poll_s=0.2)
        print("ready", os.getpid(), flush=True)
        time.sleep(60)

    if __name__ == "__main__":
        mode, watched = sys.argv[1], int(sys.argv[2])
        p = mp.get_context("fork").Process(target=helper, args=(mode, watched), daemon=True)
        p.start()
        time.sleep(60)
    """
)


def _start(mode: str, watched: int = 0) -> tuple[subprocess.Popen, psutil.Process]:
    """The starter and its helper, once the helper is ready (it called `exit_with_parent`, or not)."""
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, mode, str(watched)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert starter.stdout is not None
    line = starter.stdout.readline().split()
    assert line[:1] == ["ready"], line
    return starter, psutil.Process(int(line[1]))


def _reap(proc: psutil.Process) -> None:
    """Kills ``proc`` if it still runs and waits for it (it is this process's child now: the subreaper)."""
    leftovers.stop([proc])
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(proc.pid, 0)


@pytest.mark.parametrize("mode", ["parent", "none"])
def test_a_helper_ends_when_its_starter_is_killed(mode: str) -> None:
    starter, helper = _start(mode)
    try:
        starter.kill()  # SIGKILL: no exit handler of the starter runs
        starter.wait()
        left = leftovers.still_running([helper], within_s=3.0 if mode == "parent" else 1.5)
        if mode == "parent":
            assert left == [], "the helper outlived its killed starter"
        else:  # the control: a helper that does not watch its parent lives on, adopted by this process
            assert left == [helper] and helper.ppid() == os.getpid()
    finally:
        _reap(helper)


def test_a_helper_ends_when_the_process_it_watches_ends() -> None:
    """The watchdog thread alone (the watched process is not the helper's OS parent, as under a fork
    server): it ends once the watched one does, even while that one is a zombie not yet waited for."""
    watched = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        starter, helper = _start("watched", watched.pid)
        try:
            assert leftovers.still_running([helper], within_s=0.5) == [helper]  # the watched one is alive
            os.kill(watched.pid, signal.SIGKILL)  # a zombie of this process until waited for below
            assert leftovers.still_running([helper], within_s=3.0) == []
        finally:
            starter.kill()
            starter.wait()
            _reap(helper)
    finally:
        watched.kill()
        watched.wait()


def test_a_helper_whose_parent_is_already_gone_ends_at_once() -> None:
    """The race a parent-death signal leaves: the parent died before the helper set it."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    code = "import sys\nfrom mmpack.packing.processes import exit_with_parent\nexit_with_parent(int(sys.argv[1]))\n"
    ran = subprocess.run(
        [sys.executable, "-c", code + "print('alive')", str(dead.pid)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert ran.returncode == -signal.SIGKILL and "alive" not in ran.stdout, ran.stderr


def test_an_orphan_of_the_run_is_adopted_and_found_at_its_end() -> None:
    """A process whose parent exits is re-parented to the pytest process (a subreaper), so the check at the
    end of the run finds it."""
    sleeper = "[sys.executable, '-c', 'import time; time.sleep(60)'], stdout=-3, stderr=-3"  # DEVNULL
    script = f"import subprocess, sys; print(subprocess.Popen({sleeper}).pid)"
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    orphan = psutil.Process(int(ran.stdout))
    try:
        assert orphan.ppid() == os.getpid()
        assert orphan.pid in [p.pid for p in leftovers.running_descendants()]
    finally:
        _reap(orphan)
    assert orphan.pid not in [p.pid for p in leftovers.running_descendants()]
