"""The Ray engine: a stage's chunks on Ray workers of a cluster, results in chunk order.

The tasks are the local engine's: the same module-level chunk function over the same task, writing the same
files into the work folder, so shards and manifest are byte-identical to `--engine local`. Binpack stays one
step on the driver. The work folder is a URL (`-w s3://...`; the default for a URL output is
`<output>/_work`), which every node reaches, or a path on a filesystem every node mounts; with a single
node (or a local cluster) that is any folder. A local output, likewise, must be on a shared filesystem.

Each stage runs on a pool of Ray actors, one per CPU of the cluster (at most one per chunk), spread over the
nodes; each actor holds the job's context for that node, so what it works out (the tokenizer, a file's
records) serves all its chunks, and goes with the actor at the end of the stage. Chunks are handed to the
actors as they free up. An actor whose worker process or node dies is restarted and its chunk retried by
Ray (`MAX_RETRIES`); a chunk's outputs are written atomically with its done-marker last, so a retry, like a
rerun after a crash, redoes only what is missing.
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


class ChunkWorker:
    """A Ray actor: the job's context on its node, and the chunks it is given."""

    def __init__(self, ctx: JobContext) -> None:
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.ctx = ctx.on_node(self.node[:12])  # a URL work folder: this node's own cache

    def run(self, fn: Callable[[JobContext, Any], Any], item: Any) -> tuple[str, Any]:
        """(this actor's node, `fn(ctx, item)`)."""
        return self.node, fn(self.ctx, item)


def run_ray(
    ctx: JobContext,
    fn: Callable[[JobContext, T], R],
    items: list[T],
    *,
    desc: str = "",
    done: Callable[[int], None] = lambda i: None,
) -> list[R]:
    """`[fn(ctx, x) for x in items]` on a pool of Ray actors, results in item order; `done(i)` as item i
    completes. Records the tasks each node ran in `ctx.report.tasks_per_node[desc]`."""
    ray = connect()
    if not items:
        ctx.report.tasks_per_node[desc] = {}
        return []
    n_actors = max(1, min(len(items), int(ray.cluster_resources().get("CPU", 1))))
    # SPREAD: actors go round the nodes (their I/O and CPU add up) instead of filling the driver's node first
    actor = ray.remote(
        num_cpus=1, max_restarts=MAX_RETRIES, max_task_retries=MAX_RETRIES, scheduling_strategy="SPREAD"
    )(ChunkWorker)
    actors = [actor.remote(ctx) for _ in range(n_actors)]
    results: list[Any] = [None] * len(items)
    per_node: dict[str, int] = {}
    running: dict[Any, tuple[int, Any]] = {}  # ref -> (item index, actor)
    queue = iter(range(len(items)))
    try:
        for a in actors:
            _submit(a, fn, items, queue, running)
        while running:
            [ref], _ = ray.wait(list(running), num_returns=1)
            i, a = running.pop(ref)
            node, results[i] = _result(ray, ref, desc, i)
            per_node[node] = per_node.get(node, 0) + 1
            done(i)
            _submit(a, fn, items, queue, running)
    finally:
        for a in actors:
            ray.kill(a)
    ctx.report.tasks_per_node[desc] = per_node
    return results


def _submit(actor: Any, fn: Callable, items: list, queue: Any, running: dict) -> None:
    i = next(queue, None)
    if i is not None:
        running[actor.run.remote(fn, items[i])] = (i, actor)


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
