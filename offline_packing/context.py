"""The job context: what every stage and engine task of one packing job shares besides its config.

`JobContext` is frozen and travels with every task (to forked workers as they are made, to Ray workers
pickled): the run id, the work folder's address, the storage options of inputs and output, the engine and,
on a Ray worker, the node it runs on. What a process works out for the job (the tokenizer, a file's records,
the remote filesystems, the work folder's cache) hangs off the context in `JobCaches`, which never pickles:
each process fills its own, and a new job (a new context) starts from none, so nothing of an earlier job is
ever read. `JobReport` holds what the driver learns from the engine (tasks per node), for the summary.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from mmpack.offline_packing.inputs.remote import RemoteFiles

if TYPE_CHECKING:
    from mmpack.offline_packing.inputs.remote import RemoteFiles
    from mmpack.offline_packing.workdir import WorkDir
    from mmpack.packing.tokenizer import ControlTokens

T = TypeVar("T")


class _ProcessLocal:
    """An object of one process: pickling gives a new, empty one (each process keeps its own)."""

    def __reduce__(self) -> tuple[type, tuple]:
        return (type(self), ())


class JobCaches(_ProcessLocal):
    """What this process has worked out for one job, by name and key; each name keeps its `maxsize` most
    recent entries (a file's records, an open cursor: bounded; the tokenizer: one)."""

    def __init__(self) -> None:
        self._entries: dict[str, OrderedDict[Hashable, Any]] = {}

    def get(self, name: str, key: Hashable, make: Callable[[], T], maxsize: int = 1) -> T:
        """The entry `key` of `name`, made by `make()` the first time (dropping the oldest past `maxsize`)."""
        entries = self._entries.setdefault(name, OrderedDict())
        if key in entries:
            entries.move_to_end(key)
            return entries[key]  # type: ignore[no-any-return]
        value = entries[key] = make()
        while len(entries) > maxsize:
            entries.popitem(last=False)
        return value

    def take(self, name: str, key: Hashable) -> Any:
        """Removes and returns entry `key` of `name` (None if absent): a value meant to be used once."""
        return self._entries.get(name, OrderedDict()).pop(key, None)

    def put(self, name: str, key: Hashable, value: Any, maxsize: int) -> None:
        """Sets entry `key` of `name`, dropping the oldest past `maxsize`."""
        entries = self._entries.setdefault(name, OrderedDict())
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > maxsize:
            entries.popitem(last=False)


class JobReport(_ProcessLocal):
    """What the engine did, seen from the driver: Ray tasks per node, per stage (the last run of each)."""

    def __init__(self) -> None:
        self.tasks_per_node: dict[str, dict[str, int]] = {}


@dataclass(frozen=True)
class JobContext:
    """One run of a packing job, as every stage and task sees it (see the module docstring)."""

    work_dir: str  # the work folder's address: a local path or a URL
    storage_options: dict = field(default_factory=dict, hash=False)  # fsspec options of inputs, output, work
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    engine: str = "local"  # "local" or "ray"
    node: str = ""  # the Ray node a task runs on ("" on the driver): a URL work folder's cache is per node
    caches: JobCaches = field(default_factory=JobCaches, compare=False, repr=False)
    report: JobReport = field(default_factory=JobReport, compare=False, repr=False)

    def on_node(self, node: str) -> JobContext:
        """This context on a Ray worker of node `node` (its own caches)."""
        return dataclasses.replace(self, node=node, caches=JobCaches(), report=JobReport())

    @property
    def remote(self) -> RemoteFiles:
        """Remote inputs and folders (s3://, http(s)://) read with the job's storage options."""
        return self.caches.get("remote", None, lambda: RemoteFiles(self.storage_options, self.caches))

    @property
    def work(self) -> WorkDir:
        """The work folder (a URL one through this process's cache of it)."""
        from mmpack.offline_packing.workdir import WorkDir

        return self.caches.get("work", None, lambda: WorkDir(self))

    def tokenizer(self, path: str, controls: ControlTokens | None = None) -> Any:
        """The tokenizer at `path` checked for the control tokens `controls` (a `ControlTokens`: the job's
        `LengthsConfig.control_tokens`; None: Qwen's), loaded once per process (forked workers inherit the
        driver's)."""
        from mmpack.packing.tokenizer import QWEN_TOKENS, load_tokenizer

        tokens = QWEN_TOKENS if controls is None else controls
        return self.caches.get("tokenizer", (path, tokens), lambda: load_tokenizer(path, tokens))
