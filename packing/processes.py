"""Helper processes that die: the one error that names them, and how a process ended, in words (stdlib only).

Loader workers, checkpoint writers, the converter's ranks and the offline job's workers raise
`ProcessDiedError` when one of their processes is gone, so every entry point reports it as one line; the
other way round, each of those helper processes calls `exit_with_parent` first, so that none outlives the
process that started it. A command of another project (any executable) runs through `run_tied`, which gives it,
and every process it starts, the same end.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

from mmpack.packing.errors import MmpackError

T = TypeVar("T")


class ProcessDiedError(MmpackError, RuntimeError):
    """A process this job waits for died before it delivered its result; the message names it and how."""

    default_reason = "process_died"


def describe_exit(exitcode: int | None) -> str:
    """How a process ended from its `multiprocessing` exit code: "was killed by SIGKILL" for -9,
    "exited with code 1" for 1, "is still running" for None."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        return f"was killed by {_signal_name(-exitcode)}"
    return f"exited with code {exitcode}"


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def exit_with_parent(parent_pid: int | None = None, *, poll_s: float = 1.0) -> None:
    """Called first thing in a helper process: it ends (SIGKILL) within about `poll_s` seconds of the process
    that started it, however that one ends (SIGKILL and the OOM killer included).

    `parent_pid`: the starting process (default: `multiprocessing`'s parent of this process; in a process
    `multiprocessing` did not start, as a worker loop run in a thread of its consumer, nothing is done). Two
    guards, as torch's DataLoader workers have: on Linux the parent-death signal (`prctl(PR_SET_PDEATHSIG)`,
    sent by the kernel when the OS parent's thread that forked this process ends; checked again right after it
    is set, for a parent that died before), and everywhere a daemon thread that polls the parent's pid (it
    also covers a parent that is not the OS parent, as under a fork server).
    """
    if parent_pid is None:
        parent = multiprocessing.parent_process()
        if parent is None or parent.pid is None:
            return
        parent_pid = parent.pid
    os_parent = os.getppid()
    born = _start_time(parent_pid)
    if os_parent == parent_pid:
        _set_parent_death_signal(signal.SIGKILL)
    if not _alive(parent_pid, born):  # died before the signal was set: nobody will send it now
        os.kill(os.getpid(), signal.SIGKILL)
    watch = threading.Thread(
        target=_watch_parent,
        args=(parent_pid, born, os_parent, poll_s),
        daemon=True,
        name="mmpack-parent-watch",
    )
    watch.start()


def call_tied(fn: Callable[..., T], *args: Any, what: str) -> T:
    """`fn(*args)` in a forked process of its own, for code of another project that starts worker processes
    without a hook for them (Megatron-Energon's metadata step): that process calls `exit_with_parent`, and so does
    every process forked from it (`os.register_at_fork`), so none of them outlives this one. Returns what `fn`
    returns and raises what it raises (as itself when it pickles); `ProcessDiedError` naming `what` when the
    process dies without an answer."""
    mp = multiprocessing.get_context("fork")  # `fn` and its arguments go as they are, not pickled
    receive, send = mp.Pipe(duplex=False)
    # not a daemon: a daemon may not start processes of its own
    proc = mp.Process(target=_run_tied, args=(fn, args, send), name="mmpack-tied")
    proc.start()
    send.close()  # the child's end is the only one left: its death is an EOF here
    try:
        ok, value = receive.recv()
    except EOFError:
        proc.join()
        died = describe_exit(proc.exitcode)
        raise ProcessDiedError(f"{what}: its process (pid {proc.pid}) {died}; rerun the command") from None
    except BaseException:  # Ctrl-C: the process and those it forked end now, not when it is done
        proc.kill()
        proc.join()
        raise
    finally:
        receive.close()
    proc.join()
    if not ok:
        raise value
    return cast(T, value)


# `sh` between this process and a command: it leads the command's process group, and when the kernel sends it
# SIGTERM (its parent-death signal) it kills that whole group, itself included; else it exits as the command did.
_GROUP_GUARD = 'trap "kill -s KILL 0" TERM; "$@" & wait $!'
_PR_SET_PDEATHSIG = 1


def run_tied(argv: list[str], *, timeout_s: float) -> subprocess.CompletedProcess[str]:
    """`subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)` for a command of another project
    (any executable, which may start processes of its own, as `cv-preinfer` runs `ffprobe`), tied to this process:
    the command and every process it starts are killed when this process ends, however it ends, and when
    the command runs past `timeout_s` (then `subprocess.TimeoutExpired`, as `subprocess.run` raises).

    The command runs under a small `sh` guard (`_GROUP_GUARD`) that leads a process group of its own and gets
    SIGTERM as its parent-death signal (Linux; elsewhere only the timeout and Ctrl-C kill the group). A process
    the command moves to another group or session is out of reach. Its stdin is /dev/null; an exit by a signal
    reads as 128 + the signal's number. OSError when `argv[0]` is not an executable file.
    """
    if shutil.which(argv[0]) is None:
        raise FileNotFoundError(errno.ENOENT, "not an executable file", argv[0])
    proc = subprocess.Popen(
        ["/bin/sh", "-c", _GROUP_GUARD, "mmpack-guard", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        process_group=0,
        preexec_fn=die_with_parent_preexec(signal.SIGTERM),
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:  # past its time, or Ctrl-C: the whole group ends now
        _kill_group(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def die_with_parent_preexec(signum: int = signal.SIGKILL) -> Callable[[], None]:
    """A `preexec_fn` for `subprocess.Popen`: the kernel sends the child (any executable) `signum` when the thread
    that starts it ends, so when this process ends (Linux parent-death signal; elsewhere nothing). That thread
    must wait for the child, as `subprocess.run` does; a child whose starter died before the signal was set
    kills itself."""
    prctl = _libc_prctl()  # looked up before the fork: the child only calls it
    parent = os.getpid()

    def set_parent_death_signal() -> None:
        if prctl is not None and prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the starter died before the signal was set: nobody will send it now
            os.kill(os.getpid(), signal.SIGKILL)

    return set_parent_death_signal


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return cast(Callable[..., int], ctypes.CDLL(None, use_errno=True).prctl)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL to the process group `proc` leads, then `proc` waited for and its pipes closed."""
    with contextlib.suppress(ProcessLookupError):  # the group has ended already
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pipe in (proc.stdout, proc.stderr):
        if pipe is not None:
            pipe.close()


def _run_tied(fn: Callable[..., Any], args: tuple[Any, ...], send: Any) -> None:
    exit_with_parent()
    os.register_at_fork(after_in_child=_exit_with_forker)  # this process ends right after `fn`
    try:
        answer: tuple[bool, Any] = (True, fn(*args))
    except BaseException as exc:  # raised again in the caller
        answer = (False, _picklable(exc))
    send.send(answer)
    send.close()


def _exit_with_forker() -> None:
    exit_with_parent(os.getppid())


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc


def _watch_parent(parent_pid: int, born: bytes | None, os_parent: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        if os.getppid() != os_parent or not _alive(parent_pid, born):
            os.kill(os.getpid(), signal.SIGKILL)


def _set_parent_death_signal(signum: int) -> None:
    """The kernel sends `signum` to this process when its OS parent ends (Linux; elsewhere nothing)."""
    prctl = _libc_prctl()
    if prctl is not None and prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of `/proc/<pid>/stat` after the command name (state first), None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def _start_time(pid: int) -> bytes | None:
    """When process `pid` started (Linux: clock ticks since boot, so a reused pid reads as another process),
    or None where that is not known."""
    fields = _proc_stat(pid)
    return fields[19] if fields else None  # field 22 of proc(5)'s stat


def is_running(pid: int) -> bool:
    """Whether process `pid` of this host runs (a zombie, killed but not yet waited for, counts as ended)."""
    return _alive(pid, None)


def _alive(pid: int, born: bytes | None) -> bool:
    """True while `pid` runs and is the process first seen under that pid (a zombie counts as ended)."""
    if born is not None or os.path.isdir("/proc/self"):
        fields = _proc_stat(pid)
        return fields is not None and fields[0] not in (b"Z", b"X") and (born is None or fields[19] == born)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
