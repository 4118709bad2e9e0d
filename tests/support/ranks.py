"""The tests' rank launcher: ``torchrun --nproc_per_node N ARGV`` without a fresh interpreter per rank.

One fork server serves the whole pytest run. It is started once from a fresh interpreter (never forked from
pytest: a pytest process that set up gloo groups in-process leaves state behind that a forked child inherits
half-alive, and such children crash or hang), and it imports torch, megatron-core and the trainer once. Each
rank is a child forked from it that sets the environment torchrun would give it (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), moves to the launch's folder, sends its output to its
own files and runs ``ARGV`` as ``python ARGV`` would: ``-m MODULE ARGS`` as ``runpy.run_module`` under the
name ``__main__``, ``SCRIPT ARGS`` as ``runpy.run_path``. Exit handlers run as at the end of an interpreter.

The group shares one deadline: what still runs after it is killed, and the report names every rank's exit code
and its last lines. As torchrun does, once one rank fails the others are stopped (SIGTERM after a short grace,
SIGKILL after that). The few tests that test torchrun's own behaviour (its report of a killed worker, SIGTERM
to its agent) keep real ``torchrun``. Tests that run a function of theirs on each rank (not an entry point)
start ``context().Process(target=...)`` themselves and wait with ``join_or_kill``.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.context
import multiprocessing.forkserver
import os
import runpy
import signal
import socket
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# imported once by the fork server: every rank starts with them loaded
PRELOAD = (
    "torch",
    "torch.distributed",
    "numpy",
    "megatron.core.parallel_state",
    "megatron.core.models.gpt",
    "mmpack.dataloader",
    "mmpack.trainer.training",
    "mmpack.trainer.pretrain_vlm",
)
FAIL_GRACE_S = 3.0  # after one rank fails, the others' time to end on their own before SIGTERM
TERM_GRACE_S = 10.0  # after SIGTERM, before SIGKILL
_ctx: multiprocessing.context.BaseContext | None = None
_started = [0]  # ranks started in this pytest process (the suite's report counts them)
_fork_server: list[int] = []  # the fork server's pid, once started


def context() -> multiprocessing.context.BaseContext:
    """The fork-server context shared by every launch of this pytest process."""
    global _ctx
    if _ctx is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(PRELOAD))
        multiprocessing.forkserver.ensure_running()  # now, so that it is the one such child yet
        _fork_server[:] = _children_named("multiprocessing.forkserver")
        _ctx = ctx
    return _ctx


def fork_server_pids() -> list[int]:
    """The pid of the run's fork server once it started, else none (it ends with the pytest process)."""
    return list(_fork_server)


def _children_named(command: str) -> list[int]:
    """Pids of this process's children whose command line holds ``command``."""
    import psutil

    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if command in " ".join(child.cmdline()):
                found.append(child.pid)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def ranks_started() -> int:
    return _started[0]


@dataclass
class RankExit:
    """One rank's outcome: its exit code (negative: the signal that ended it) and its output."""

    rank: int
    exitcode: int | None
    stdout: str
    stderr: str


@dataclass
class Launch:
    """Outcome of one launch, as torchrun's would read: ``returncode`` 0 when every rank exited 0, else the
    exit code of the rank that failed first; ``stdout`` / ``stderr`` the ranks' outputs in rank order."""

    ranks: list[RankExit]
    failed_first: int | None
    timed_out: bool
    seconds: float
    pids: list[int] = field(default_factory=list)

    @property
    def returncode(self) -> int:
        if self.failed_first is None:
            return 0
        code = self.ranks[self.failed_first].exitcode
        return 1 if code is None else code

    @property
    def stdout(self) -> str:
        return "".join(r.stdout for r in self.ranks)

    @property
    def stderr(self) -> str:
        return "".join(r.stderr for r in self.ranks)

    def report(self, lines: int = 15) -> str:
        """Every rank's exit code and the last lines of its output (for an assertion message)."""
        head = f"{len(self.ranks)} ranks, {self.seconds:.1f} s" + (
            ", killed at the deadline" if self.timed_out else ""
        )
        parts = [head]
        for r in self.ranks:
            tail = (r.stdout + r.stderr).splitlines()[-lines:]
            parts.append(f"-- rank {r.rank}: exit {r.exitcode}\n" + "\n".join(tail))
        return "\n".join(parts)


def _rank_main(argv: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """A rank: torchrun's environment, its output to files, ``python ARGV`` run in this forked process."""
    from mmpack.packing.processes import exit_with_parent

    exit_with_parent()  # a pytest run killed outright takes its ranks with it (their parent is the fork server)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        sys.stdout.flush()
        sys.stderr.flush()
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - for the life of the rank
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    if env.get("PYTHONWARNINGS") == "ignore":
        warnings.simplefilter("ignore")
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    code = _run_as_main(argv)
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
        code = code or 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_as_main(argv: list[str]) -> int:
    """``python ARGV``: a module (``-m NAME ARGS``) or a script (``PATH ARGS``); returns the exit code."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = str(Path(argv[0]).resolve())
            sys.argv = [script, *argv[1:]]
            sys.path[0:0] = [str(Path(script).parent), str(REPO)]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def launch(
    nproc: int,
    argv: Sequence[str],
    folder: Path,
    *,
    cwd: Path = REPO,
    env: dict[str, str] | None = None,
    timeout_s: float = 420,
    while_running: Callable[[list[BaseProcess]], float | None] | None = None,
) -> Launch:
    """Runs ``ARGV`` on ``nproc`` ranks (as ``torchrun --standalone --nproc_per_node nproc ARGV``) with one
    deadline for the group; each rank's output goes to ``folder/rank{N}.{out,err}``. ``while_running`` is
    called once with the rank processes after they started (to signal one, say), within the deadline; when it
    returns a number of seconds, the group's deadline becomes that long from then (if sooner): after a kill,
    the time the rest of the group has to end."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    path = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
    ctx = context()
    procs = []
    start = time.monotonic()
    for rank in range(nproc):
        rank_env = {
            **base,
            "PYTHONPATH": path,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc),
            "ROLE_WORLD_SIZE": str(nproc),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "tests",
        }
        out, err = folder / f"rank{rank}.out", folder / f"rank{rank}.err"
        p = ctx.Process(target=_rank_main, args=(list(argv), rank_env, str(cwd), str(out), str(err)))
        p.start()
        procs.append(p)
    _started[0] += nproc
    deadline = start + timeout_s
    try:
        if while_running is not None:
            seconds = while_running(procs)
            if seconds is not None:
                deadline = min(deadline, time.monotonic() + seconds)
        failed_first, timed_out = _wait(procs, deadline)
    finally:
        for p in procs:
            if p.exitcode is None:
                p.kill()
            p.join()
    ranks = [
        RankExit(r, p.exitcode, _read(folder / f"rank{r}.out"), _read(folder / f"rank{r}.err"))
        for r, p in enumerate(procs)
    ]
    if timed_out and failed_first is None:
        failed_first = next((r.rank for r in ranks if r.exitcode != 0), 0)
    return Launch(ranks, failed_first, timed_out, time.monotonic() - start, [p.pid or 0 for p in procs])


def _wait(procs: list[BaseProcess], deadline: float) -> tuple[int | None, bool]:
    """Waits for every rank until the deadline; once one fails, stops the rest as torchrun does. Returns
    (the rank that failed first, whether the deadline was reached)."""
    failed_first: int | None = None
    stop_at: float | None = None
    terminated = False
    while True:
        running = [p for p in procs if p.exitcode is None]
        if failed_first is None:
            failed_first = next((i for i, p in enumerate(procs) if p.exitcode not in (None, 0)), None)
            if failed_first is not None:
                stop_at = time.monotonic() + FAIL_GRACE_S
        if not running:
            return failed_first, False
        now = time.monotonic()
        if now >= deadline:
            for p in running:
                p.kill()
            return failed_first, True
        if stop_at is not None and now >= stop_at:
            for p in running:
                with contextlib.suppress(ProcessLookupError):
                    p.kill() if terminated else p.terminate()
            stop_at, terminated = now + TERM_GRACE_S, True
        multiprocessing.connection.wait([p.sentinel for p in running], timeout=0.2)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def checked(run: Launch) -> Launch:
    """``run``, after checking that every rank exited 0 (the report of every rank if not)."""
    assert run.returncode == 0 and not run.timed_out, run.report()
    return run


def join_or_kill(procs: Sequence[BaseProcess], timeout_s: float) -> None:
    """Waits for every process (of ``context()``) within one shared deadline; kills those still running after
    it (their exit codes then read negative, so the caller's assertion names them)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.exitcode is None:
            p.kill()
            p.join()


def warm_start_method() -> str:
    """The start method for code that starts its own rank processes (``mmpack.trainer.convert``'s
    ``start_method``): this run's warm fork server instead of a fresh interpreter per rank ("spawn")."""
    context()
    return "forkserver"
