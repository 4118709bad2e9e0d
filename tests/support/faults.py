"""Runs an mmpack entry point with a test fault armed from the environment (no fault: the entry point as is).

    python -m tests.support.faults trainer ARGS...   (under torchrun: the trainer's ranks)
    python -m tests.support.faults mmpack ARGS...    (the `mmpack` command, e.g. `convert`)

``MMPACK_TEST_STALL_WRITER=DIR:RANK``: every checkpoint writer process of global rank RANK (megatron-core's
``FileSystemWriterAsync.write_preloaded_data``, in the forked writer) writes its pid to ``DIR/writer-<pid>``
and waits there, so a test can kill it (or its rank) mid-save. It is armed at import, so the processes
``torch.multiprocessing.spawn`` starts (which import this module again) have it too.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

STALL_WRITER_ENV = "MMPACK_TEST_STALL_WRITER"


def _arm_stalled_writer(spec: str) -> None:
    import torch.distributed as dist
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    folder, _, rank = spec.rpartition(":")
    original = FileSystemWriterAsync.write_preloaded_data

    def stalled(*args: Any, **kwargs: Any) -> Any:
        if dist.get_rank() == int(rank):
            # the rank's pid and the writer's bucket index (the writers of a rank are forked in index order)
            (Path(folder) / f"writer-{os.getpid()}").write_text(f"{os.getppid()} {args[1]}")
            time.sleep(120)
        return original(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(stalled)  # type: ignore[method-assign]


if os.environ.get(STALL_WRITER_ENV):
    _arm_stalled_writer(os.environ[STALL_WRITER_ENV])


def main(argv: list[str]) -> int:
    what, rest = argv[0], argv[1:]
    if what == "trainer":
        from mmpack.trainer.pretrain_vlm import main as trainer_main

        return trainer_main(rest)
    from mmpack.cli import main as mmpack_main

    return mmpack_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
