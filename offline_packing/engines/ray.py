"""The Ray engine: a stage's chunks as Ray tasks on a cluster, results in chunk order.

The tasks are the local engine's: the same module-level chunk function over the same chunk, writing the same
files into the work folder, so shards and manifest are byte-identical to `--engine local`. Binpack stays one
step on the driver. The work folder is a URL (`-w s3://...`; the default for a URL output is
`<output>/_work`), which every node reaches, or a path on a filesystem every node mounts; with a single
node (or a local cluster) that is any folder. A local output, likewise, must be on a shared filesystem. A task whose worker process or node dies is retried by
Ray (`MAX_RETRIES`); a chunk's outputs are written atomically with its done-marker last, so a retry, like a
rerun after a crash, redoes only what is missing.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from mmpack.offline_packing.errors import PackError

T = TypeVar("T")
R = TypeVar("R")
MAX_RETRIES = 4  # system failures (worker or node died) per task; a task's own exceptions are not retried
# Test-only fault injection: "<stage>:<marker file>" makes one task of that stage SIGKILL its own worker
# process, once (the marker file records that it did), so tests can show the retry leaves output unchanged.
KILL_ONCE_ENV = "MMPACK_TEST_RAY_KILL_ONCE"
_PROCESS_RUN: dict[str, str] = {}
TASKS_PER_NODE: dict[str, dict[str, int]] = {}  # stage -> Ray node id -> tasks it ran, of the last run_ray


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise PackError(
            "--engine ray needs Ray, which is not installed: pip install -e .[ray] "
            "(or pip install 'ray[data]'), or use --engine local"
        ) from None
    return ray


def connect(address: str = "auto") -> Any:
    """Connect to Ray once per process: `address` "auto" joins the cluster running on this machine or, when
    none runs, starts a local one; any other value (`ray://host:10001`, `host:6379`) must answer."""
    ray = _import_ray()
    if ray.is_initialized():
        return ray
    quiet: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": True}
    if address == "auto":
        try:
            ray.init(address="auto", **quiet)
        except ConnectionError:
            ray.init(include_dashboard=False, **quiet)
        return ray
    try:
        ray.init(address=address, **quiet)
    except ConnectionError as exc:
        raise PackError(f"cannot reach the Ray cluster at --ray-address {address}: {exc}") from None
    return ray


def run_ray(
    fn: Callable[[T], R],
    items: list[T],
    *,
    weights: list[int] | None = None,
    desc: str = "",
    unit: str = "samples",
    progress: bool = True,
) -> list[R]:
    """`[fn(x) for x in items]` as one Ray task per item, results in item order, with a progress bar."""
    from tqdm import tqdm

    from mmpack.offline_packing.inputs import remote

    ray = connect()
    weights = weights if weights is not None else [1] * len(items)
    from mmpack.offline_packing import workdir

    setup = {
        "run": uuid.uuid4().hex,
        "storage_options": remote.current_options(),
        "workdir_run": workdir.current_run(),
    }
    kill_at = _kill_request(desc, len(items))
    # SPREAD: chunks go round the nodes (their I/O and CPU add up) instead of filling the driver's node first
    task = ray.remote(
        num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False, scheduling_strategy="SPREAD"
    )(_run_chunk)
    refs = [
        task.remote(fn, item, setup, kill_at[1] if i == kill_at[0] else None) for i, item in enumerate(items)
    ]
    index = {ref: i for i, ref in enumerate(refs)}
    bar = tqdm(
        total=sum(weights),
        desc=f"{desc} (ray)",
        unit=unit,
        disable=not progress,
        file=sys.stderr,
        dynamic_ncols=True,
    )
    pending = list(refs)
    try:
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            _raise_failure(ray, done[0], desc, index[done[0]])
            bar.update(weights[index[done[0]]])
        outcomes = [ray.get(ref) for ref in refs]
    finally:
        bar.close()
    per_node: dict[str, int] = {}
    for node, _ in outcomes:
        per_node[node] = per_node.get(node, 0) + 1
    TASKS_PER_NODE[desc] = per_node
    return [result for _, result in outcomes]


def _raise_failure(ray: Any, ref: Any, desc: str, i: int) -> None:
    """Re-raise a failed task's own error (as the local engine would), or name the chunk Ray gave up on."""
    try:
        ray.get(ref)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.cause if isinstance(exc.cause, BaseException) else None
        if cause is not None:
            raise cause from None
        raise PackError(f"{desc} chunk {i} failed on Ray: {exc}") from None
    except ray.exceptions.RayError as exc:
        raise PackError(
            f"{desc} chunk {i}: Ray gave up after {MAX_RETRIES} retries ({type(exc).__name__}: {exc}); "
            "check the cluster's workers, then rerun: finished chunks are kept"
        ) from None


def _kill_request(desc: str, n_items: int) -> tuple[int, str | None]:
    """(index of the task that kills its worker, marker file) from KILL_ONCE_ENV, or (-1, None)."""
    spec = os.environ.get(KILL_ONCE_ENV, "")
    stage, _, marker = spec.partition(":")
    if not marker or stage != desc or n_items == 0:
        return -1, None
    return n_items // 2, marker


def _run_chunk(fn: Callable[[T], R], item: T, setup: dict, kill_marker: str | None) -> tuple[str, R]:
    """One chunk on a Ray worker: the job's input options, caches of an earlier run dropped, then `fn`;
    returns (the node it ran on, `fn(item)`)."""
    import ray

    from mmpack.offline_packing import workdir
    from mmpack.offline_packing.inputs import remote

    node = ray.get_runtime_context().get_node_id()
    if _PROCESS_RUN.get("run") != setup["run"]:
        _reset_process_caches()
        _PROCESS_RUN["run"] = setup["run"]
    remote.configure(setup["storage_options"])
    workdir.start_run(setup["workdir_run"], node=node[:12])  # a URL work folder: this node's own cache
    if kill_marker is not None and not os.path.exists(kill_marker):
        with open(kill_marker, "w") as f:
            f.write(f"killed worker pid {os.getpid()}\n")
        import signal

        os.kill(os.getpid(), signal.SIGKILL)
    return node, fn(item)


def _reset_process_caches() -> None:
    """Ray workers outlive a stage (a forked pool does not): drop what a process caches per job, so a rerun
    with a new plan or tokenizer in the same work folder never reads the old one."""
    from mmpack.offline_packing import lengths, write

    write._SOURCES.clear()
    lengths._TOKENIZERS.clear()
