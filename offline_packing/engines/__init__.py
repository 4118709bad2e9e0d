"""Where a stage's independent chunks run: `local` (forked worker processes on this machine) or `ray`
(Ray workers of a cluster). Both run the same module-level chunk functions `fn(ctx, task)` over the same
tasks, each with the job's context (`mmpack.offline_packing.context.JobContext`), so the output does not
depend on the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext

T = TypeVar("T")
R = TypeVar("R")


def run_parallel(
    ctx: JobContext,
    fn: Callable[[JobContext, T], R],
    items: list[T],
    *,
    workers: int,
    weights: list[int] | None = None,
    desc: str = "",
    unit: str = "samples",
    progress: bool = True,
) -> list[R]:
    """`[fn(ctx, x) for x in items]` on the context's engine, results in item order, with a progress bar
    (`weights`: each item's share of it). `workers`: processes of the local engine, at most one per CPU and per
    item (`engines.workers.capped_workers`; Ray uses the cluster's CPUs)."""
    from tqdm import tqdm

    weights = weights if weights is not None else [1] * len(items)
    bar = tqdm(
        total=sum(weights),
        desc=f"{desc} (ray)" if ctx.engine == "ray" else desc,
        unit=unit,
        disable=not progress,
        dynamic_ncols=True,
    )
    try:
        if ctx.engine == "ray":
            from mmpack.offline_packing.engines.ray import run_ray

            return run_ray(ctx, fn, items, desc=desc, done=lambda i: bar.update(weights[i]))
        from mmpack.offline_packing.engines.local import run_local

        return run_local(ctx, fn, items, workers=workers, done=lambda i: bar.update(weights[i]), desc=desc)
    finally:
        bar.close()
