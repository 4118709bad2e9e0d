"""The two folders a packing job writes, claimed and locked before the first stage runs.

The output (-o) is claimed as a "dataset" folder and the work folder as a "work" folder
(`mmpack.packing.ownership`): a folder that is not empty and carries no mmpack marker is refused before
anything is written (`--overwrite` adopts it; nothing of it but the files the job writes is touched). Both are
then locked for the job's duration (`mmpack.packing.joblock`), so a second job on the same output or work
folder stops at once, naming the first. `--clean-work` deletes only the work folder's own files
(`mmpack.offline_packing.workdir.is_work_file`), then its marker and the folder if nothing else is left.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.workdir import is_work_file
from mmpack.packing.joblock import JobLock, hold_lock
from mmpack.packing.ownership import OwnedFolder, claim_folder, is_local

_OUTPUT, _WORK = "output (-o)", "work folder (--work-dir)"


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


@contextmanager
def claim_job_folders(cfg: PackJobConfig, work_address: str) -> Iterator[JobFolders]:
    """Claim the output and the work folder, and hold their locks inside the block.

    Raises:
        FolderNotOwned: a folder is not mmpack's (see the module docstring).
        FolderLocked: another job holds one of them.
        PackError: the output and the work folder are one folder.
    """
    if _same_folder(cfg.output, work_address):
        raise PackError(
            f"the output (-o) and the work folder (--work-dir) are one folder, {cfg.output}; give another --work-dir"
        )

    def claim(url: str, kind: str, role: str) -> OwnedFolder:
        return claim_folder(
            url,
            kind,
            overwrite=cfg.control.overwrite,
            overwrite_flag="--overwrite",
            storage_options=cfg.control.storage_options,
            role=role,
        )

    output = claim(cfg.output, "dataset", _OUTPUT)
    work = claim(work_address, "work", _WORK)
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
