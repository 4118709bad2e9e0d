"""The Ray engine: a stage's chunks on Ray workers of a cluster, results in chunk order.

The tasks are the local engine's: the same module-level chunk function over the same task, writing the same
files into the work folder, so shards and manifest are byte-identical to `--engine local`. Binpack stays one
step on the driver. The work folder is a URL (`-w s3://...`; the default for a URL output is
`<output>/_work`), which every node reaches, or a path on a filesystem every node mounts; with a single
node (or a local cluster) that is any folder. A local output, likewise, must be on a shared filesystem.

Each stage is one Ray remote function, one task per chunk, spread over the nodes: the stage's chunk
function with the job's context (`stage_task`). Ray sends a remote function to each worker process once
and the process keeps it, so the context it carries, and what that worker works out for the job (the
tokenizer, a file's records: the context's caches, on that worker's node), serves every chunk the process
runs in the stage, in warm worker processes Ray reuses. A task whose worker process or node dies is
retried by Ray (`MAX_RETRIES`); a chunk's outputs are written atomically with its done-marker last, so a
retry, like a rerun after a crash, redoes only what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from mmpack.offline_packing.errors import PackError

if TYPE_CHECKING:
    from mmpack.offline_packing.context import JobContext

T = TypeVar("T")
R = TypeVar("R")
MAX_RETRIES = 4  # system failures (worker or node died) per chunk; a chunk's own exceptions are not retried


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


def stage_task(ctx: JobContext, fn: Callable[[JobContext, T], R]) -> Callable[[T], tuple[str, R]]:
    """The function a stage's Ray tasks run: `item -> (node id, fn(ctx on this node, item))`. The context
    for the worker's node is made at its first chunk and kept by the function (each worker process holds
    its own copy of it), so its caches serve the worker's later chunks of the stage."""
    local: dict[str, JobContext] = {}  # this process's context, once made

    def run(item: T) -> tuple[str, R]:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if node not in local:
            local[node] = ctx.on_node(node[:12])  # a URL work folder: this node's own cache
        return node, fn(local[node], item)

    return run


def run_ray(
    ctx: JobContext,
    fn: Callable[[JobContext, T], R],
    items: list[T],
    *,
    desc: str = "",
    done: Callable[[int], None] = lambda i: None,
) -> list[R]:
    """`[fn(ctx, x) for x in items]` as one Ray task per item, results in item order; `done(i)` as item i
    completes. Records the tasks each node ran in `ctx.report.tasks_per_node[desc]`."""
    ray = connect()
    # SPREAD: chunks go round the nodes (their I/O and CPU add up) instead of filling the driver's node first
    task = ray.remote(
        num_cpus=1, max_retries=MAX_RETRIES, retry_exceptions=False, scheduling_strategy="SPREAD"
    )(stage_task(ctx, fn))
    refs = [task.remote(item) for item in items]
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(items)
    per_node: dict[str, int] = {}
    pending = list(refs)
    while pending:
        [ref], pending = ray.wait(pending, num_returns=1)
        i = index[ref]
        node, results[i] = _result(ray, ref, desc, i)
        per_node[node] = per_node.get(node, 0) + 1
        done(i)
    ctx.report.tasks_per_node[desc] = per_node
    return results


def _result(ray: Any, ref: Any, desc: str, i: int) -> Any:
    """A chunk's result; its own error re-raised (as the local engine would), or one naming the chunk Ray
    gave up on."""
    try:
        return ray.get(ref)
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
