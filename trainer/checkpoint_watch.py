"""Checkpoint writes that end in an error naming the writer, never in a hang, when a writer process dies.

megatron-core's ``FileSystemWriterAsync.write_preloaded_data_multiproc`` forks one writer process per bucket
of a rank's shards and waits on a ``JoinableQueue`` that only a writer that got to its end marks done: a writer
that dies first (killed, out of memory, an exception before its ``try``, such as a missing ``psutil``) leaves
its rank waiting forever, and every other rank behind it at the next collective. :func:`watched_request`
swaps in :func:`write_buckets`, which runs megatron-core's own per-bucket writer
(``FileSystemWriterAsync.write_preloaded_data``, same files, same results) in the same forked processes, but
waits on each one's pipe, which a dead writer closes: a writer that dies or fails raises
:class:`~mmpack.packing.processes.ProcessDiedError` on its own rank, naming the process, its file and its
error. Under ``--async-save`` the whole write runs in megatron-core's forked checkpoint process, which sends
its outcome to the rank over a pipe (:class:`AsyncSaveWatch`), so that process dying is caught too.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection, wait
from multiprocessing.managers import SyncManager
from typing import Any

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

from mmpack.packing.processes import ProcessDiedError, describe_exit, exit_with_parent


class _PipeQueue:
    """The ``results_queue`` that megatron-core's bucket writer puts its one result on, over a pipe."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.sent = conn, False

    def put(self, item: tuple[int, Any]) -> None:
        index, outcome = item
        if isinstance(outcome, BaseException):  # exceptions need not pickle: their text does
            outcome = f"{type(outcome).__name__}: {outcome}"
        self.conn.send((index, outcome))
        self.sent = True


class _NoCount:
    """The ``count_queue`` the bucket writer marks itself done on; here each writer's pipe says that."""

    def get(self) -> None:
        pass

    def task_done(self) -> None:
        pass


def _write_one(transform_list: list, use_msc: bool, index: int, bucket: Any, conn: Connection) -> None:
    """In a forked writer: megatron-core's writer for one bucket; sends (index, [WriteResult] or error text)."""
    exit_with_parent()  # a rank killed outright takes its writers with it
    results = _PipeQueue(conn)
    extra = {"use_msc": True} if use_msc else {}
    try:
        FileSystemWriterAsync.write_preloaded_data(
            transform_list, index, bucket, results, _NoCount(), True, **extra
        )
    except BaseException as e:  # raised outside megatron-core's own try: report it like one inside
        if not results.sent:
            results.put((index, e))


@dataclass
class _Writer:
    process: Any
    conn: Connection
    file: str

    def name(self, rank: int) -> str:
        return f"checkpoint writer process {self.process.pid} of rank {rank} (writing {self.file})"


@contextlib.contextmanager
def _gc_disabled() -> Iterator[None]:
    """As megatron-core's writers: no collection while forked writers share the parent's tensors."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def write_buckets(
    transform_list: list,
    use_msc: bool,
    rank: int,
    buckets: list,
    results_queue: Any,
    *,
    report: Connection | None = None,
) -> None:
    """``FileSystemWriterAsync.write_preloaded_data_multiproc`` with its writers watched: puts
    {bucket index: [WriteResult]} on ``results_queue`` once every writer delivered.

    A writer that dies or fails raises :class:`ProcessDiedError` naming it; with ``report`` (the
    ``--async-save`` process) the outcome, None or that message, is sent there instead of raised."""
    if report is not None:  # in the forked --async-save process: it ends with its rank
        exit_with_parent()
    try:
        with _gc_disabled():
            results = _run_writers(transform_list, use_msc, rank, buckets)
    except ProcessDiedError as e:
        if report is None:
            raise
        results_queue.put(RuntimeError(e.message))  # megatron-core's own finalize sees the failure too
        report.send(e.message)
        return
    results_queue.put(results)
    if report is not None:
        report.send(None)


def _run_writers(transform_list: list, use_msc: bool, rank: int, buckets: list) -> dict[int, list]:
    ctx = mp.get_context("fork")  # as megatron-core: the writers read the parent's staged tensors
    writers: list[_Writer] = []
    try:
        # each pipe is made just before its writer is forked and its sending end closed here right after, so
        # that no later writer inherits it: the writer holds the only sending end, and its death shows as end
        # of file here even while the other writers are still at work
        for i, bucket in enumerate(buckets):
            recv, send = ctx.Pipe(duplex=False)
            args = (transform_list, use_msc, i, bucket, send)
            writer = _Writer(ctx.Process(target=_write_one, args=args, daemon=True), recv, str(bucket[0]))
            writer.process.start()
            send.close()
            writers.append(writer)
        return _collect(writers, rank)
    finally:
        for writer in writers:
            if writer.process.is_alive():  # the checkpoint failed: the other writers' work is moot
                writer.process.kill()
            writer.process.join()
            writer.conn.close()


def _collect(writers: list[_Writer], rank: int) -> dict[int, list]:
    pending = {w.conn: w for w in writers}
    results: dict[int, list] = {}
    while pending:
        for conn in wait(list(pending)):
            writer = pending.pop(conn)  # type: ignore[call-overload]
            try:
                index, outcome = writer.conn.recv()
            except EOFError:
                writer.process.join(timeout=5)
                raise ProcessDiedError(
                    f"{writer.name(rank)} {describe_exit(writer.process.exitcode)} before it finished"
                ) from None
            if isinstance(outcome, str):
                raise ProcessDiedError(f"{writer.name(rank)} failed: {outcome}")
            results[index] = outcome
    return results


def watched_request(request: AsyncRequest, report: Connection | None = None) -> AsyncRequest:
    """``request`` (from ``dist_checkpointing.save(..., async_sharded_save=True)``) writing through
    :func:`write_buckets`; a request with nothing to write on this rank is returned as it is."""
    fn = request.async_fn
    if fn is None:
        return request
    if not (isinstance(fn, partial) and fn.func is FileSystemWriterAsync.write_preloaded_data_multiproc):
        raise RuntimeError(f"megatron-core's checkpoint writer is not the one mmpack watches: {fn!r}")
    return request._replace(async_fn=partial(write_buckets, *fn.args, **fn.keywords, report=report))


def save_request(state: dict[str, Any], folder: str) -> AsyncRequest:
    """``dist_checkpointing.save(state, folder, async_sharded_save=True)`` (collective): the request that writes
    this rank's shards, its writers' results reported to a queue that ends with this process."""
    _own_results_queue()
    return dist_checkpointing.save(state, folder, async_sharded_save=True)


def save_watched(state: dict[str, Any], folder: str) -> None:
    """``dist_checkpointing.save(state, folder)`` (synchronous, collective) with the writers watched."""
    watched_request(save_request(state, folder)).execute_sync()


def _own_results_queue() -> None:
    """Gives megatron-core's ``FileSystemWriterAsync`` its results queue before it makes one itself.

    megatron-core serves that queue from a ``multiprocessing`` manager, a process spawned once per rank and
    stopped only by the rank's exit handlers: a rank killed outright (SIGKILL, the OOM killer) left it running
    for ever. This is the same kind of manager, forked and started with :func:`exit_with_parent`, so it ends with its rank; set
    once per process, where megatron-core keeps it (its module's ``_results_queue``)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if getattr(filesystem_async, "_results_queue", None) is not None:
        return
    # forked, as the writers are: a spawned manager (megatron-core's choice) is a fresh interpreter that imports
    # the rank's main module again, about 6 s of CPU and 370 MB per saving rank, for a server that only holds a
    # queue; the forked one starts in milliseconds and touches neither torch nor CUDA
    manager = SyncManager(ctx=mp.get_context("fork"))
    manager.start(exit_with_parent, (os.getpid(),))
    # the proxy keeps the manager (and its process) alive
    filesystem_async._results_queue = manager.Queue()  # type: ignore[assignment]


def started_process(start: Callable[[], Any]) -> Any:
    """Runs ``start`` and returns the ``multiprocessing`` child process it started, or None."""
    before = set(mp.active_children())
    start()
    new = [p for p in mp.active_children() if p not in before]
    return new[0] if len(new) == 1 else None


class AsyncSaveWatch:
    """The pipe over which one ``--async-save`` process reports how its write ended (see :func:`write_buckets`)."""

    def __init__(self, rank: int, what: str) -> None:
        self.rank, self.what = rank, what
        self.conn, self.send_end = mp.Pipe(duplex=False)
        self.process: Any = None

    def started(self, process: Any) -> None:
        """After megatron-core forked ``process`` (its ``multiprocessing.Process``, None when not found):
        only that process holds the sending end now."""
        self.process = process
        self.send_end.close()

    def check(self, *, blocking: bool) -> bool:
        """True once the process reported success; raises :class:`ProcessDiedError` when it failed or died;
        False while it is still writing (``blocking`` waits for it)."""
        if not blocking and not self.conn.poll():
            return False
        try:
            message = self.conn.recv()
        except EOFError:
            raise ProcessDiedError(f"{self._describe_death()} before it finished {self.what}") from None
        finally:
            self.conn.close()
        if message is not None:
            raise ProcessDiedError(message)
        return True

    def _describe_death(self) -> str:
        if self.process is None:
            return f"the async checkpoint process of rank {self.rank} died"
        self.process.join(timeout=5)
        how = describe_exit(self.process.exitcode)
        return f"async checkpoint process {self.process.pid} of rank {self.rank} {how}"
