"""The local engine: a stage's chunks on forked worker processes of this machine, results in chunk order.

A chunk's function is a module-level pure function of its task, so results do not depend on the number of
workers (or on the engine: a Ray engine runs the same tasks).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import TypeVar

from mmpack.packing.processes import ProcessDiedError

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(
    fn: Callable[[T], R],
    items: list[T],
    *,
    workers: int,
    weights: list[int] | None = None,
    desc: str = "",
    unit: str = "samples",
    progress: bool = True,
) -> list[R]:
    """`[fn(x) for x in items]`, on `workers` processes, results in item order, with a progress bar.

    `fn` must be a module-level function of its item alone (a pure function of its chunk), so the
    results do not depend on the number of workers.
    """
    from tqdm import tqdm

    weights = weights if weights is not None else [1] * len(items)
    bar = tqdm(
        total=sum(weights), desc=desc, unit=unit, disable=not progress, file=sys.stderr, dynamic_ncols=True
    )
    results: list[R] = []
    try:
        for i, result in enumerate(_map_ordered(fn, items, workers, desc)):
            results.append(result)
            bar.update(weights[i])
    finally:
        bar.close()
    return results


def _map_ordered(fn: Callable[[T], R], items: list[T], workers: int, desc: str) -> Iterator[R]:
    if workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    # fork: workers inherit imported modules (numba, tokenizers) instead of importing them again. An executor,
    # not a Pool: a Pool replaces a worker that dies and waits forever for the chunk it took with it.
    ctx = multiprocessing.get_context("fork")
    pool = ProcessPoolExecutor(min(workers, len(items)), mp_context=ctx)
    try:
        futures = [pool.submit(fn, item) for item in items]
        for i, future in enumerate(futures):
            try:
                yield future.result()
            except BrokenProcessPool:
                raise ProcessDiedError(
                    f"{desc or 'stage'}: a worker process of the local engine died (killed, or out of memory) "
                    f"before chunk {i} of {len(items)} was done; rerun the same command: finished chunks "
                    "are kept"
                ) from None
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
