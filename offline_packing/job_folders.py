"""The two folders a packing job writes, claimed and locked before the first stage runs.

The output (-o) is claimed as a "dataset" folder and the work folder as a "work" folder
(`mmpack.packing.ownership`): a folder that is not empty and carries no mmpack marker is refused before
anything is written (`--overwrite` adopts it; nothing of it but the files the job writes is touched). Both are
claimed only once the inputs are expanded (`check_job_folders` first), so a run refused for a folder or an
input (one inside the output or work folder) leaves no marker anywhere. Both are then locked for the job's
duration (`mmpack.packing.joblock`), so a second job on the same output or work
folder stops at once, naming the first. `--clean-work` deletes only the work folder's own files
(`mmpack.offline_packing.workdir.is_work_file`), then its marker and the folder if nothing else is left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.workdir import is_work_file
from mmpack.packing.joblock import JobLock, hold_lock
from mmpack.packing.ownership import OwnedFolder, check_claim, claim_folder, is_local

_OUTPUT, _WORK = "output (-o)", "work folder (--work-dir)"
# what --overwrite does to a folder it adopts, as the refusal says it (`offline_packing.write`: the dataset's
# files; `workdir.is_work_file`: the work folder's)
_OUTPUT_REPLACED = (
    "its manifest.json, stats.json, rejects.jsonl, .nv-meta/ files and shards/<prefix>-NNNNNN files replace "
    "yours of the same names"
)
_WORK_REPLACED = (
    "its stage files (<stage>.done.json, scan/, lengths/, binpack/, write/) replace yours of the same names"
)


@dataclass(frozen=True)
class JobFolders:
    """The claimed output and work folders of a running job, and the locks it holds on them."""

    output: OwnedFolder
    work: OwnedFolder
    locks: tuple[JobLock, ...]

    def check(self) -> None:
        """Raises `FolderLocked` if another job took over a lease of this one (object stores)."""
        for lock in self.locks:
            lock.check()


def check_job_folders(cfg: PackJobConfig, work_address: str) -> None:
    """Raises what `claim_job_folders` would for a folder that is not the job's, writing nothing (the job
    checks its folders, then expands its inputs, then claims the folders: a refused run leaves no marker).

    Raises:
        FolderNotOwned: a folder is not mmpack's (see the module docstring).
        PackError: the output and the work folder are one folder.
    """
    _refuse_one_folder(cfg, work_address)
    for url, kind, claim in _folders(cfg, work_address):
        check_claim(url, kind, **claim)


def _folders(cfg: PackJobConfig, work_address: str) -> tuple[tuple[str, str, dict[str, Any]], ...]:
    """(url, kind, the keyword arguments of `check_claim` and `claim_folder`) of the output and of the work
    folder."""
    return (
        (cfg.output, "dataset", _claim_arguments(cfg, _OUTPUT, _OUTPUT_REPLACED)),
        (work_address, "work", _claim_arguments(cfg, _WORK, _WORK_REPLACED)),
    )


def _claim_arguments(cfg: PackJobConfig, role: str, replaces: str) -> dict[str, Any]:
    return {
        "overwrite": cfg.control.overwrite,
        "overwrite_flag": "--overwrite",
        "storage_options": cfg.control.storage_options,
        "role": role,
        "replaces": replaces,
    }


def _refuse_one_folder(cfg: PackJobConfig, work_address: str) -> None:
    if _same_folder(cfg.output, work_address):
        raise PackError(
            f"the output (-o) and the work folder (--work-dir) are one folder, {cfg.output}; give another --work-dir"
        )


@contextmanager
def claim_job_folders(cfg: PackJobConfig, work_address: str) -> Iterator[JobFolders]:
    """Claim the output and the work folder, and hold their locks inside the block.

    Raises:
        FolderNotOwned: a folder is not mmpack's (see the module docstring).
        FolderLocked: another job holds one of them.
        PackError: the output and the work folder are one folder.
    """
    _refuse_one_folder(cfg, work_address)
    output, work = [claim_folder(url, kind, **claim) for url, kind, claim in _folders(cfg, work_address)]
    try:
        with ExitStack() as stack:
            locks = tuple(
                stack.enter_context(
                    hold_lock(folder.url, role=role, storage_options=cfg.control.storage_options)
                )
                for folder, role in ((output, _OUTPUT), (work, _WORK))
            )
            yield JobFolders(output, work, locks)
    except BaseException:
        for folder in (work, output):  # made by this job and still empty (a bad -i): not left behind
            if folder.created:
                folder.release()
        raise


def remove_work_files(work: OwnedFolder) -> list[str]:
    """`--clean-work`, under the job's lock: delete the files the job writes in its work folder, only those."""
    return work.remove_recorded([rel for rel in work.files() if is_work_file(rel)])


def _same_folder(a: str, b: str) -> bool:
    if is_local(a) and is_local(b):
        return os.path.realpath(a.removeprefix("file://")) == os.path.realpath(b.removeprefix("file://"))
    return a.rstrip("/") == b.rstrip("/")
