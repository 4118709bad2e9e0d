"""The local engine: a stage's chunks on forked worker processes of this machine, results in chunk order.

A chunk's function is a module-level pure function of (job context, task), so results do not depend on the
number of workers (or on the engine: the Ray engine runs the same tasks). The workers are forked with the
driver's context as it is (not pickled): what the driver has worked out for the job (the tokenizer, loaded
once) is theirs without loading it again, and what a worker works out stays with it for its next tasks.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mmpack.offline_packing.engines.workers import capped_workers
from mmpack.offline_packing.errors import PackError
from mmpack.packing.processes import ProcessDiedError, describe_exit, exit_with_parent

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext

T = TypeVar("T")
R = TypeVar("R")
POLL_S = 1.0  # how often the driver checks that its workers are alive while it waits


def run_local(
    ctx: JobContext,
    fn: Callable[[JobContext, T], R],
    items: list[T],
    *,
    workers: int,
    done: Callable[[int], None] = lambda i: None,
    desc: str = "",
) -> list[R]:
    """`[fn(ctx, x) for x in items]` on `workers` forked processes (at most one per CPU and per item:
    `capped_workers`); `done(i)` as item i completes.

    An item's error is raised once every item before it has completed, so the error raised is that of the
    first failing item, whatever the number of workers. A worker that dies (killed, out of memory) is a
    `ProcessDiedError` naming the stage (`desc`), the worker and the first chunk not done, never a hang.
    """
    workers = capped_workers(workers, len(items))
    if workers <= 1:
        results = []
        for i, item in enumerate(items):
            results.append(fn(ctx, item))
            done(i)
        return results
    mp = multiprocessing.get_context("fork")  # workers inherit imported modules and the context
    tasks, answers = mp.Queue(), mp.Queue()  # fed by threads: neither side blocks the other
    procs = [
        mp.Process(target=_serve, args=(ctx, fn, tasks, answers), daemon=True, name=f"mmpack-pack-{w}")
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    for i, item in enumerate(items):
        tasks.put((i, item))
    for _ in procs:
        tasks.put(None)
    try:
        return _collect(answers, procs, len(items), done, desc)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()


def _collect(answers: Any, procs: list[Any], n: int, done: Callable[[int], None], desc: str) -> list[Any]:
    results: list[Any] = [None] * n
    finished = [False] * n
    first_error: tuple[int, BaseException] | None = None
    while not all(finished[: first_error[0] if first_error else n]):
        try:
            i, ok, value = answers.get(timeout=POLL_S)
        except queue.Empty:
            dead = [f"{p.name} {describe_exit(p.exitcode)}" for p in procs if p.exitcode not in (None, 0)]
            if dead or all(p.exitcode == 0 for p in procs):
                raise ProcessDiedError(
                    f"{desc or 'stage'}: a worker process of the local engine died ({', '.join(dead) or 'unknown'}"
                    f") before chunk {finished.index(False)} of {n} was done; rerun the same command: finished "
                    "chunks are kept"
                ) from None
            continue
        finished[i] = True
        if ok:
            results[i] = value
            done(i)
        elif first_error is None or i < first_error[0]:
            first_error = (i, value)
    if first_error is not None:
        raise first_error[1]
    return results


def _serve(ctx: JobContext, fn: Callable[[JobContext, Any], Any], tasks: Any, answers: Any) -> None:
    """A worker: runs tasks until the end marker; an error is sent back (as itself when it pickles)."""
    exit_with_parent()  # a killed driver takes its workers with it
    while (task := tasks.get()) is not None:
        i, item = task
        try:
            answers.put((i, True, fn(ctx, item)))
        except BaseException as exc:  # reported in the driver, which raises it
            answers.put((i, False, _picklable(exc)))


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return PackError(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
