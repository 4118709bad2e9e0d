"""Where a stage's independent chunks run: `local` (forked worker processes on this machine) or `ray`
(tasks on a Ray cluster). Both run the same module-level chunk functions over the same chunks, so the
output does not depend on the engine.

The job selects the engine for its duration (`use_engine`); the stages call `run_parallel`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from mmpack.offline_packing.config import ENGINES

T = TypeVar("T")
R = TypeVar("R")
_ACTIVE: dict[str, str] = {"engine": "local", "ray_address": "auto"}


@contextmanager
def use_engine(engine: str, ray_address: str = "auto") -> Iterator[None]:
    """Run the stages inside the block on `engine` ("local" or "ray"); Ray is connected to on entry."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "ray":
        from mmpack.offline_packing.engines.ray import connect

        connect(ray_address)
    previous = dict(_ACTIVE)
    _ACTIVE.update(engine=engine, ray_address=ray_address)
    try:
        yield
    finally:
        _ACTIVE.update(previous)


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
    """`[fn(x) for x in items]` on the active engine, results in item order (see `engines.local`)."""
    if _ACTIVE["engine"] == "ray":
        from mmpack.offline_packing.engines.ray import run_ray

        return run_ray(fn, items, weights=weights, desc=desc, unit=unit, progress=progress)
    from mmpack.offline_packing.engines.local import run_parallel as run_local

    return run_local(fn, items, workers=workers, weights=weights, desc=desc, unit=unit, progress=progress)
