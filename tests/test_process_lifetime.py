"""No helper process outlives the process that started it (`mmpack.packing.processes.exit_with_parent`), and
the test run sees every process it leaves behind (`tests.support.leftovers`, the session-finish check).

Each case is a small Python process that forks one helper; the test kills the starter (SIGKILL, nothing
runs in it after) and times the helper's end. The control, a helper that does not call `exit_with_parent`,
lives on (and is stopped by the test). The same for an executable of another project run by `run_tied`
(a stand-in `cv-preinfer` that starts a process of its own), against a plain `subprocess.run`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.support import leftovers
from tests.support.ranks import REPO
from tests.support.shared import need_import

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


ENERGON_STARTER = textwrap.dedent(
    """\
    import os, sys, threading, time
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator
    from mmpack.offline_packing.outputs.energon_meta import write_energon_metadata

    def stuck(cls, path, **kw):  # an Energon worker reading a shard, for ever
        print("worker", os.getpid(), file=sys.__stdout__, flush=True)
        time.sleep(60)
        yield from ()

    WebdatasetPreparator._preprocess_tar = classmethod(stuck)
    out = sys.argv[1]
    paths = [f"shards/a-{i:06d}.tar" for i in range(2)]
    # the control: Energon's preparation called in this process, as a thread of it. It starts once the tied
    # process is forked: a fork while this thread holds an import lock (Energon imports lazily) would leave the
    # child waiting on that lock for ever
    forked = threading.Event()
    os.register_at_fork(after_in_parent=forked.set)
    def control():
        forked.wait()
        WebdatasetPreparator.prepare_dataset(os.path.join(out, "control"), paths, workers=2)
    threading.Thread(target=control, daemon=True).start()
    # what `mmpack pack --energon` runs
    write_energon_metadata(os.path.join(out, "tied"), [{"path": p, "sha256": "0" * 64} for p in paths], 2)
    """
)


def test_energons_metadata_workers_end_when_the_job_is_killed(tmp_path: Path) -> None:
    """`--energon`: the processes Megatron-Energon forks for its metadata step end with a killed job, as those
    of the same step called in the job's own process (the control) do not."""
    need_import("megatron.energon", extra="energon")
    for name in ("control", "tied"):
        (tmp_path / name).mkdir()
    with open(tmp_path / "stderr", "w+") as stderr:
        starter = subprocess.Popen(
            [sys.executable, "-c", ENERGON_STARTER, str(tmp_path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    assert starter.stdout is not None
    n = min(2, len(os.sched_getaffinity(0)))  # workers of each preparation
    workers: list[psutil.Process] = []
    lines: queue.Queue[str] = queue.Queue()  # read beside the test, so that waiting for a line has a deadline
    threading.Thread(target=lambda: [lines.put(x) for x in iter(starter.stdout.readline, "")] + [lines.put("")],
                     daemon=True).start()  # fmt: skip
    deadline = time.monotonic() + 120
    while len(workers) < 2 * n:  # Energon's own progress lines come in between
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            starter.kill()
            pytest.fail(f"{len(workers)} of {2 * n} Energon workers started within 120 s")
        assert line, (tmp_path / "stderr").read_text()  # the starter ended
        if line.startswith("worker "):
            workers.append(psutil.Process(int(line.split()[1])))
    job = leftovers.job_processes([starter.pid])
    control = [p for p in workers if p.ppid() == starter.pid]
    tied = [p for p in job if p.pid != starter.pid and p not in control]
    assert len(control) == n and len(tied) == n + 1  # Energon's workers and the process they were forked in
    try:
        starter.kill()
        starter.wait()
        assert leftovers.still_running(tied, within_s=5.0) == [], (
            "a process of the metadata step outlived the job"
        )
        assert leftovers.still_running(control, within_s=0) == control  # the control: adopted, still running
    finally:
        for proc in job:
            _reap(proc)


def test_a_tied_call_returns_raises_and_names_its_death() -> None:
    """`call_tied`: `fn`'s value and error come back from its process; a process that dies is one line."""
    from mmpack.packing.processes import ProcessDiedError, call_tied

    assert call_tied(divmod, 7, 2, what="step") == (3, 1)
    with pytest.raises(ZeroDivisionError):
        call_tied(divmod, 7, 0, what="step")
    with pytest.raises(
        ProcessDiedError, match=r"^step: its process \(pid \d+\) was killed by SIGKILL; rerun"
    ):
        call_tied(lambda: os.kill(os.getpid(), signal.SIGKILL), what="step")  # the child's own pid


# A stand-in `cv-preinfer`: it starts a process of its own (as the real one runs ffprobe), records both pids and
# waits for it.
TOOL = '#!/bin/sh\nsleep 60 &\necho "$$ $!" > {pids}\nwait\n'

TOOL_STARTER = textwrap.dedent(
    """\
    import subprocess, sys
    from mmpack.offline_packing.inputs.codec_preinfer import CodecPreinfer

    tool, video, cache, mode = sys.argv[1:5]
    codec = CodecPreinfer(executable=tool, cache_dir=cache)
    if mode == "tied":
        codec.assets_of(video, 10, name="v")
    else:  # the control: the command run as it was before it was tied
        subprocess.run(codec.command(video, cache, 10), capture_output=True, timeout=60)
    """
)


def _tool(root: Path) -> tuple[Path, Path, Path]:
    """The stand-in executable under ``root``, the file it writes its pids to, and a video for it."""
    exe, pids, video = root / "cv-preinfer", root / "pids", root / "v.mp4"
    exe.write_text(TOOL.format(pids=pids))
    exe.chmod(0o755)
    video.write_bytes(b"not decoded")
    return exe, pids, video


def _tool_pids(pids: Path, within_s: float = 20.0) -> list[int]:
    """The pids of the stand-in and of the process it started, once it has written them."""
    deadline = time.monotonic() + within_s
    while not (pids.exists() and pids.read_text().endswith("\n")):
        assert time.monotonic() < deadline, "the stand-in cv-preinfer did not start"
        time.sleep(0.05)
    return [int(pid) for pid in pids.read_text().split()]


def _running_after(pids: list[int], within_s: float) -> list[int]:
    """Those of ``pids`` that still run after up to ``within_s`` seconds (one already reaped has ended)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(pid))
    return [p.pid for p in leftovers.still_running(procs, within_s)]


def _reap_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            _reap(psutil.Process(pid))


@pytest.mark.parametrize("mode", ["tied", "untied"])
def test_cv_preinfer_ends_with_a_killed_packer(mode: str, tmp_path: Path) -> None:
    """`--codec-videos`: a packer process killed while `cv-preinfer` runs takes it, and the process it started,
    with it (`run_tied`); the control, the same command started by a plain `subprocess.run`, lives on."""
    exe, pids, video = _tool(tmp_path)
    starter = subprocess.Popen(
        [sys.executable, "-c", TOOL_STARTER, str(exe), str(video), str(tmp_path / "cache"), mode],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    job: list[int] = []
    try:
        tool = _tool_pids(pids)
        job = [p.pid for p in leftovers.job_processes([starter.pid]) if p.pid != starter.pid]
        assert set(tool) <= set(job), (tool, job)
    finally:
        starter.kill()
        starter.wait()
    try:
        if mode == "tied":  # the guard, the stand-in and its child
            assert len(job) == 3 and _running_after(job, within_s=5.0) == [], (
                "cv-preinfer outlived the packer"
            )
        else:
            assert _running_after(job, within_s=1.0) == job
    finally:
        _reap_pids(job)


@pytest.mark.parametrize("mode", ["tied", "untied"])
def test_cv_preinfer_past_its_time_ends_with_what_it_started(mode: str, tmp_path: Path) -> None:
    """`cv-preinfer` past its `timeout_s` is a reject, and its whole process group is killed; the control, a
    plain `subprocess.run` timeout, kills the tool only: the process it started lives on."""
    from mmpack.offline_packing.inputs.codec_preinfer import CodecPreinfer
    from mmpack.packing.video_codec_ov2 import CodecAssetError

    exe, pids, video = _tool(tmp_path)
    codec = CodecPreinfer(executable=str(exe), cache_dir=str(tmp_path / "cache"), timeout_s=1.0)
    if mode == "tied":
        with pytest.raises(CodecAssetError, match=r"^codec video v: cv-preinfer ran past 1 s"):
            codec.assets_of(str(video), 10, name="v")
    else:
        with pytest.raises(subprocess.TimeoutExpired):
            subprocess.run(codec.command(str(video), str(tmp_path), 10), capture_output=True, timeout=1.0)
    tool, child = _tool_pids(pids, within_s=0)
    try:
        assert _running_after([tool], within_s=2.0) == []
        if mode == "tied":
            assert _running_after([child], within_s=2.0) == []
        else:
            assert _running_after([child], within_s=0.5) == [child]
    finally:
        _reap_pids([tool, child])
