"""How a checkpoint folder changes on disk: an iteration is written to a staging folder, checksummed and
renamed when every rank has written it, and the tracker file moves to it last; loading takes the newest
complete iteration and verifies its files first.

Layout (Megatron-LM's, plus the staging folder and the checksums)::

    <root>/latest_checkpointed_iteration.txt   the iteration to resume from (written last)
    <root>/iter_0000010/                        a complete iteration: its files and checksums.json
    <root>/iter_0000020.tmp/                    an iteration being written, or left by a crash: never read

``checksums.json`` holds the size and SHA-256 of every other file of the iteration. The ranks split the
hashing (and, on load, the verification) between them, so each reads about 1/world of the checkpoint.

The folder carries mmpack's ownership marker (:mod:`mmpack.packing.ownership`, kind "checkpoint"); files are
deleted only through it, and only those of an iteration folder this module wrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mmpack.packing.ownership import FolderNotOwned, claim_folder, open_owned

TRACKER = "latest_checkpointed_iteration.txt"
HF_CONFIG_NAME = "hf_config.json"  # the model's config.json, kept beside the trainer's checkpoints
CHECKSUMS = "checksums.json"
STAGING_SUFFIX = ".tmp"
_REPLACED_SUFFIX = ".replaced"  # an older save of the same iteration, removed once the new one is in place
_ITERATION_NAME = re.compile(r"iter_(\d{7})")


class CorruptCheckpointError(ValueError):
    """A checkpoint file that is missing, truncated or changed since it was written."""


def iteration_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def staging_dir(root: str | Path, iteration: int) -> Path:
    """Where ``iteration`` is written before it is complete."""
    return Path(root) / f"iter_{iteration:07d}{STAGING_SUFFIX}"


def latest_iteration(root: str | Path) -> int | None:
    """The iteration recorded in ``root``'s tracker file, or None when there is no checkpoint."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{tracker} holds {text!r}, not an iteration number")
    return int(text)


def write_tracker(root: str | Path, iteration: int) -> None:
    """Points the tracker at ``iteration`` (atomically: a crash leaves the old or the new number)."""
    tracker = Path(root) / TRACKER
    tmp = tracker.with_suffix(".tmp")
    tmp.write_text(str(iteration))
    os.replace(tmp, tracker)


def is_complete(folder: Path) -> bool:
    """A committed iteration (checksums.json), or one written before checksums existed (metadata.json,
    dist_checkpointing's last file)."""
    return folder.is_dir() and ((folder / CHECKSUMS).is_file() or (folder / "metadata.json").is_file())


def complete_iterations(root: str | Path) -> list[int]:
    """The iterations of ``root`` that are complete, oldest first."""
    base = Path(root)
    if not base.is_dir():
        return []
    found = (_ITERATION_NAME.fullmatch(p.name) for p in base.iterdir())
    return sorted(int(m.group(1)) for m in found if m and is_complete(base / m.group(0)))


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _all_gather(value: Any) -> list[Any]:
    """``value`` of every rank (a list of one without a process group)."""
    if not dist.is_initialized():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _my_share(sizes: dict[str, int]) -> list[str]:
    """This rank's part of the files: largest first, dealt round-robin, so the bytes spread evenly."""
    rank, world = _rank_world()
    ordered = sorted(sizes, key=lambda name: (-sizes[name], name))
    return ordered[rank::world]


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path) -> None:
    """Collective: records size and SHA-256 of every file of ``folder`` in its checksums.json."""
    rank, _ = _rank_world()
    listing = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()} if rank == 0 else None
    sizes: dict[str, int] = _all_gather(listing)[0]  # one listing for all (a shared FS may lag)
    mine = {name: {"size": sizes[name], "sha256": _sha256(folder / name)} for name in _my_share(sizes)}
    merged = {name: entry for part in _all_gather(mine) for name, entry in part.items()}
    if rank == 0:
        tmp = folder / (CHECKSUMS + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"algorithm": "sha256", "files": dict(sorted(merged.items()))}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, folder / CHECKSUMS)


def commit(root: str | Path, iteration: int) -> None:
    """Collective, once every rank has written ``iteration``'s staging folder: checksums, the rename to
    ``iter_*``, then the tracker. An older save of the same iteration is replaced."""
    staging = staging_dir(root, iteration)
    write_checksums(staging)
    rank, _ = _rank_world()
    if rank == 0:
        final = iteration_dir(root, iteration)
        replaced = final.with_name(final.name + _REPLACED_SUFFIX)
        remove_iteration_folder(root, replaced)
        if final.exists():
            os.rename(final, replaced)
        os.rename(staging, final)
        write_tracker(root, iteration)
        remove_iteration_folder(root, replaced)
    if dist.is_initialized():
        dist.barrier()


def remove_iteration_folder(root: str | Path, folder: Path) -> None:
    """Deletes an iteration folder of ``root`` this module wrote (a staging folder, a replaced iteration):
    the files its checksums.json records, or all of a staging folder's (made empty by the writer), through
    the folder's ownership marker. Anything else in it stays, and so does the folder then."""
    if not folder.is_dir():
        return
    owned = open_owned(str(root), "checkpoint")
    listing = folder / CHECKSUMS
    if listing.is_file():
        names = [*json.loads(listing.read_text())["files"], CHECKSUMS]
    else:
        names = [p.name for p in folder.iterdir()] if folder.name.endswith(STAGING_SUFFIX) else []
    owned.remove_recorded(f"{folder.name}/{name}" for name in names)


def _holds_only_checkpoints(root: str | Path) -> bool:
    """An unmarked folder written by the trainer before folders were marked: nothing but its layout."""
    base = Path(root)
    names = [p.name for p in base.iterdir()] if base.is_dir() else []
    layout = re.compile(rf"iter_\d{{7}}({re.escape(STAGING_SUFFIX)}|{re.escape(_REPLACED_SUFFIX)})?")
    files = (TRACKER, Path(TRACKER).with_suffix(".tmp").name, HF_CONFIG_NAME)
    ours = [n for n in names if n in files or layout.fullmatch(n)]
    return bool(names) and len(ours) == len(names) and TRACKER in names


def claim_checkpoint_folder(root: str | Path, *, role: str) -> None:
    """Collective: rank 0 takes ``root`` for checkpoints by the ownership rule (a new, empty or marked
    folder; one the trainer wrote before markers existed is adopted); every rank raises the same
    ``FolderNotOwned`` otherwise."""
    rank, _ = _rank_world()
    error = None
    if rank == 0:
        try:
            claim_folder(str(root), "checkpoint", overwrite=_holds_only_checkpoints(root), role=role)
        except FolderNotOwned as e:
            error = str(e)
    error = _all_gather(error)[0]
    if error is not None:
        raise FolderNotOwned(error)


def resolve_iteration(root: str | Path) -> tuple[int | None, str | None]:
    """(iteration to load, warning): the tracker's iteration, or, when its folder is missing or incomplete,
    the newest complete one before it (with a warning saying so). (None, None): no checkpoint."""
    pointed = latest_iteration(root)
    if pointed is None:
        return None, None
    folder = iteration_dir(root, pointed)
    if is_complete(folder):
        return pointed, None
    what = "does not exist" if not folder.exists() else "is incomplete (no checksums.json)"
    older = [i for i in complete_iterations(root) if i < pointed]
    if older:
        return older[-1], (
            f"warning: {Path(root) / TRACKER} points at iteration {pointed}, but {folder} {what}: loading "
            f"iteration {older[-1]}, the newest complete checkpoint"
        )
    raise ValueError(
        f"{Path(root) / TRACKER} points at iteration {pointed}, but {folder} {what} and {root} holds no "
        f"complete checkpoint; to start from iteration 0 instead, remove {Path(root) / TRACKER}"
    )


def previous_good(root: str | Path, iteration: int) -> str:
    """Advice naming the newest complete checkpoint before ``iteration`` (none: say so)."""
    older = [i for i in complete_iterations(root) if i < iteration]
    if not older:
        return f"{root} holds no complete checkpoint before iteration {iteration}"
    return (
        f"the previous complete checkpoint is iteration {older[-1]} ({iteration_dir(root, older[-1])}): to "
        f"resume from it, write {older[-1]} into {Path(root) / TRACKER}"
    )


def _problem(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{path} is {size} bytes, {entry['size']} were written (truncated or replaced)"
    if _sha256(path) != entry["sha256"]:
        return f"{path} does not match its checksum (zeroed or changed bytes)"
    return None


def verify_checkpoint(root: str | Path, iteration: int) -> str | None:
    """Collective: checks every file of ``iteration`` against its checksums.json (each rank a share);
    raises :class:`CorruptCheckpointError` on every rank naming the first bad file and the previous good
    iteration. Returns a note when the iteration has no checksums (written before they existed)."""
    folder = iteration_dir(root, iteration)
    listing = folder / CHECKSUMS
    if not listing.is_file():
        return f"{folder} has no {CHECKSUMS} (written before checksums existed): not verified"
    try:
        files: dict[str, dict[str, Any]] = json.loads(listing.read_text())["files"]
    except (ValueError, KeyError) as e:
        raise CorruptCheckpointError(
            f"{listing} is damaged ({e}); {previous_good(root, iteration)}"
        ) from None
    mine = [p for name in _my_share({n: e["size"] for n, e in files.items()})
            if (p := _problem(folder, name, files[name])) is not None]  # fmt: skip
    problems = sorted(p for part in _all_gather(mine) for p in part)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpointError(
            f"checkpoint iteration {iteration} is damaged: {problems[0]}{more}; {previous_good(root, iteration)}"
        )
    return None
