"""The local engine: results in item order whatever the number of workers, the first failing item's error
(as the one-process run raises it), and a worker that dies is an error, never a hang."""

from __future__ import annotations

import pytest

from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines import run_parallel
from mmpack.packing.processes import ProcessDiedError
from tests.support.engine_tasks import fail_on

CTX = JobContext(work_dir="unused")


@pytest.mark.parametrize("workers", [1, 3])
def test_results_and_first_error_do_not_depend_on_workers(workers: int) -> None:
    items = [(i, set()) for i in range(9)]
    assert run_parallel(CTX, fail_on, items, workers=workers, progress=False) == [i * i for i in range(9)]
    bad = [(i, {2, 6}) for i in range(9)]
    with pytest.raises(ValueError, match="item 2 is bad"):
        run_parallel(CTX, fail_on, bad, workers=workers, progress=False)


def test_a_dead_worker_is_an_error() -> None:
    with pytest.raises(
        ProcessDiedError,
        match=r"worker process of the local engine died \(mmpack-pack-\d exited "
        r"with code 3\) before chunk [01] of 3",
    ):
        run_parallel(CTX, fail_on, [(0, set()), (-1, set()), (2, set())], workers=2, progress=False)
