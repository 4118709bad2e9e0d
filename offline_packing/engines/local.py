"""The local engine: a stage's chunks on forked worker processes of this machine, results in chunk order.

A chunk's function is a module-level pure function of its task, so results do not depend on the number of
workers (or on the engine: a Ray engine runs the same tasks).
"""

from __future__ import annotations

import multiprocessing
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

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
        for i, result in enumerate(_map_ordered(fn, items, workers)):
            results.append(result)
            bar.update(weights[i])
    finally:
        bar.close()
    return results


def _map_ordered(fn: Callable[[T], R], items: list[T], workers: int) -> Iterator[R]:
    if workers <= 1 or len(items) <= 1:
        yield from map(fn, items)
        return
    # fork: workers inherit imported modules (numba, tokenizers) instead of importing them again
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(workers, len(items))) as pool:
        yield from pool.imap(fn, items, chunksize=1)
