"""The offline packing job: scan -> lengths -> binpack -> write, each stage resumable.

`run_pack(PackJobConfig(...)) -> PackSummary` is the Python API; `mmpack pack`, `auto_pipe.sh` and
`python -m offline_packing.<stage>` all end here. A stage is skipped when it completed with the fingerprint
it has now (its own config, the stages before it, the identity of every file it reads; see
`mmpack.offline_packing.fingerprint`); otherwise it and every stage after it are redone. `-S N` reruns from stage
N, which needs stages 1..N-1 complete and current.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

from mmpack.offline_packing.binpack import run_binpack
from mmpack.offline_packing.config import STAGES, PackJobConfig
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines.ray import connect
from mmpack.offline_packing.errors import PackError, describe_failure
from mmpack.offline_packing.finalize import fill_efficiency, finalize
from mmpack.offline_packing.fingerprint import identities, stage_fingerprint
from mmpack.offline_packing.flags import parse_job_args
from mmpack.offline_packing.inputs.sources import expand_inputs
from mmpack.offline_packing.job_folders import (
    JobFolders,
    check_job_folders,
    claim_job_folders,
    remove_work_files,
)
from mmpack.offline_packing.lengths import run_lengths
from mmpack.offline_packing.outputs.energon_meta import require_energon
from mmpack.offline_packing.scan import run_scan, scan_output_fingerprint
from mmpack.offline_packing.storage import OutputStore
from mmpack.offline_packing.summary import PackSummary
from mmpack.offline_packing.write import record_previous_dataset, remove_unlisted_outputs, run_write_shards
from mmpack.packing.format import MANIFEST_NAME, STATS_NAME
from mmpack.packing.manifest import Manifest
from mmpack.packing.ownership import OwnedFolder
from mmpack.packing.tokenizer import tokenizer_files


def resolve_work_dir(cfg: PackJobConfig) -> str:
    """The work folder of a job (a local path or a URL): `work_dir_of` its output, work dir and engine."""
    control = cfg.control
    return work_dir_of(cfg.output, control.work_dir, control.engine, control.storage_options)


def work_dir_of(
    output: str, work_dir: str | None, engine: str = "local", storage_options: dict | None = None
) -> str:
    """--work-dir; else `<output>/_work` for a local output, and for a URL output under `--engine ray` (every
    node reaches it); else, a URL output on one machine, a local temp folder named after the output URL (so a
    rerun finds it)."""
    if work_dir is not None:
        return work_dir
    store = OutputStore(output, storage_options or {})
    if store.is_local:
        return str(store.local_path("_work"))
    if engine == "ray":
        return f"{output.rstrip('/')}/_work"
    digest = hashlib.sha256(output.encode()).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"mmpack-work-{digest}")


def _fingerprint(ctx: JobContext, cfg: PackJobConfig, stage: str, previous: str, files: list[str]) -> str:
    """The fingerprint `stage` has now, after a stage whose output fingerprint is `previous`."""
    inputs: list[str] = []
    if stage == "scan":
        inputs = files
    elif stage == "lengths":
        inputs = tokenizer_files(cfg.tokenizer)
    read = identities(ctx.remote, inputs, cfg.verify_inputs)
    return stage_fingerprint(stage, cfg.stage_config(stage), previous, read)


def _completed(ctx: JobContext, cfg: PackJobConfig, stage: str, fingerprint: str) -> str | None:
    """The output fingerprint of `stage` if it completed with `fingerprint` and is still current, else None."""
    if stage == "scan":
        return scan_output_fingerprint(ctx, fingerprint, cfg.verify_inputs)
    if not ctx.work.is_done(stage, fingerprint) or not _outputs_present(ctx, cfg, stage):
        return None
    return fingerprint


def _run_stage(
    ctx: JobContext, cfg: PackJobConfig, stage: str, fingerprint: str, files: list[str], output: OwnedFolder
) -> str:
    """Run `stage`; returns its output fingerprint (what the next stage builds on)."""
    workers, progress = cfg.control.workers, cfg.control.progress
    if stage == "scan":
        info = run_scan(ctx, cfg.stage_config("scan"), files, fingerprint, workers=workers, progress=progress)
        return str(info["output_fingerprint"])
    if stage == "lengths":
        run_lengths(ctx, cfg.stage_config("lengths"), fingerprint, workers=workers, progress=progress)
    elif stage == "binpack":
        run_binpack(ctx.work, cfg.stage_config("binpack"), fingerprint)
    else:
        _run_write(ctx, cfg, fingerprint, output)
    return fingerprint


def _run_write(ctx: JobContext, cfg: PackJobConfig, fingerprint: str, output: OwnedFolder) -> None:
    wd = ctx.work
    store = OutputStore(cfg.output, ctx.storage_options, staging_dir=wd.stage_dir("write"))
    if not output.created:  # a folder adopted now (--overwrite): its old manifest lists the user's files
        record_previous_dataset(store, wd)
    store.remove(MANIFEST_NAME)  # the dataset is uncommitted while its shards are (re)written
    control = cfg.control
    shards = run_write_shards(
        ctx, cfg.stage_config("write"), fingerprint, workers=control.workers, progress=control.progress
    )
    finalize(ctx, cfg, shards)
    remove_unlisted_outputs(output, wd, cfg.write, shards)
    wd.mark_done("write", fingerprint, {})


def _clear_chunk_markers(ctx: JobContext, stage: str) -> None:
    ctx.work.remove(f"{stage}/*.done.json")
    ctx.work.remove(f"{stage}/shard-*.json")


def run_pack(cfg: PackJobConfig) -> PackSummary:
    """Run the packing job described by `cfg`; returns its summary.

    The output and the work folder are claimed and locked first (`mmpack.offline_packing.job_folders`).

    Raises:
        PackError: a `--strict` reject, `--overlength error`, a damaged gzip input, or `-S N` without stages
            1..N-1 complete.
        FolderNotOwned: the output or work folder is not empty and carries no mmpack marker (see --overwrite).
        FolderLocked: another job holds the output or the work folder.
        FileNotFoundError: an input (-i) or the tokenizer does not exist.
        OSError: the output or work folder cannot be written; an input is not a regular file.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    tokenizer_files(cfg.tokenizer)  # a missing tokenizer fails before the first stage, not after it
    if cfg.write.energon:
        require_energon()
    control = cfg.control
    if control.engine == "ray":
        connect(control.ray_address)
    # inputs (s3://...) are read with the output's storage options
    ctx = JobContext(
        work_dir=resolve_work_dir(cfg), storage_options=control.storage_options, engine=control.engine
    )
    # the folders checked, then the inputs (never its own files), then the folders claimed (marked): a run
    # refused for either leaves no marker, in an input's folder least of all
    check_job_folders(cfg, ctx.work_dir)
    files = expand_inputs(ctx.remote, cfg.inputs, exclude=(cfg.output, ctx.work_dir))
    with claim_job_folders(cfg, ctx.work_dir) as folders:
        wd = ctx.work  # a URL work folder: this run's empty local cache, so nothing stale is read
        wd.root.mkdir(parents=True, exist_ok=True)
        try:
            summary = _run_stages_in(ctx, cfg, files, folders)
        finally:
            wd.close()
        clean = control.clean_work and "write" in (*summary.stage_seconds, *summary.stages_skipped)
        if clean:
            remove_work_files(folders.work)
    if clean:
        folders.work.release()  # its marker and the folder, once the lock file is gone too
    return summary


def _run_stages_in(ctx: JobContext, cfg: PackJobConfig, files: list[str], folders: JobFolders) -> PackSummary:
    control = cfg.control
    first = control.only_stage or control.start_stage or 1
    last = control.only_stage or len(STAGES)
    summary = PackSummary(output=cfg.output)
    forced = control.only_stage is not None or control.start_stage is not None
    previous, redo_rest, wrote = "", False, False
    wd = ctx.work
    for n, name in enumerate(STAGES[:last], start=1):
        fingerprint = _fingerprint(ctx, cfg, name, previous, files)
        completed = _completed(ctx, cfg, name, fingerprint)
        if n < first:
            if completed is None:
                raise PackError(
                    f"cannot start at stage {first} ({STAGES[first - 1]}): stage {n} ({name}) has not "
                    f"completed with these options and inputs in {wd.address}; run the earlier stages first (or "
                    "the whole job without -S)"
                )
            previous = completed
            continue
        if not (forced or redo_rest) and completed is not None:
            summary.stages_skipped.append(name)
            previous, wrote = completed, name == "write"
            continue
        folders.check()  # an object-store lease lost to another job: stop before writing more
        redo_rest = True  # every later stage depends on this one
        wd.forget(name)  # a URL work folder: this stage's files are about to change
        wd.clear_marker(name)
        if forced:
            _clear_chunk_markers(ctx, name)
        start = time.perf_counter()
        previous = _run_stage(ctx, cfg, name, fingerprint, files, folders.output)
        summary.stage_seconds[name] = time.perf_counter() - start
        wrote = name == "write"
    summary.tasks_per_node = dict(ctx.report.tasks_per_node)
    if wrote:
        _fill_summary(summary, ctx, cfg)
    return summary


def run_pack_reporting(cfg: PackJobConfig, command: str = "mmpack pack") -> int:
    """`run_pack` for a command line: the summary on stderr and exit code 0, or one line
    `<command>: error: ...` and exit code 1 (the traceback too with `cfg.debug`)."""
    try:
        summary = run_pack(cfg)
    except KeyboardInterrupt:
        print(f"{command}: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except Exception as exc:
        if cfg.control.debug:
            traceback.print_exc()
        print(f"{command}: error: {describe_failure(exc)}", file=sys.stderr)
        return 1
    if summary.stage_seconds or summary.stages_skipped:
        print(summary.format_table(), file=sys.stderr)
    return 0


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """`python -m offline_packing.<stage> <mmpack pack flags>`: run that stage only."""
    n = STAGES.index(stage) + 1
    prog = f"python -m offline_packing.{stage}"
    cfg = parse_job_args(argv, prog=prog, description=f"stage {n} ({stage}) of `mmpack pack`", only_stage=n)
    return run_pack_reporting(cfg, prog)


def _outputs_present(ctx: JobContext, cfg: PackJobConfig, stage: str) -> bool:
    """The write stage also needs its manifest to still be in the output (it may have been deleted)."""
    if stage != "write":
        return True
    return OutputStore(cfg.output, ctx.storage_options).size(MANIFEST_NAME) is not None


def _fill_summary(summary: PackSummary, ctx: JobContext, cfg: PackJobConfig) -> None:
    store = OutputStore(cfg.output, ctx.storage_options)
    manifest = _read_output_manifest(store)
    stats = _read_output_json(store, STATS_NAME)
    counts = manifest.counts
    assert counts is not None  # the writer always records them
    summary.samples_read = counts.samples_read
    summary.samples_packed = counts.samples_packed
    summary.samples_rejected = counts.samples_rejected
    summary.rejected_by_reason = dict(counts.rejected_by_reason)
    summary.bins = counts.bins
    summary.tokens = counts.tokens
    summary.image_tokens = counts.image_tokens
    summary.video_tokens = counts.video_tokens or 0
    summary.samples_truncated = counts.truncated or 0
    summary.shards = [e.to_dict() for e in manifest.shards]
    summary.output_bytes = sum(e.bytes for e in manifest.shards)
    summary.fill_efficiency = fill_efficiency(stats)


def read_manifest(output: str, storage_options: dict | None = None) -> dict:
    """The manifest of a packed dataset as plain JSON values, checked by `mmpack.packing.manifest.Manifest`."""
    return _read_output_manifest(OutputStore(output, storage_options)).to_dict()


def _read_output_manifest(store: OutputStore) -> Manifest:
    with store.fs.open(store.full_path(MANIFEST_NAME), "rb") as f:
        return Manifest.from_json(f.read(), source=store.full_path(MANIFEST_NAME))


def _read_output_json(store: OutputStore, name: str) -> dict:
    with store.fs.open(store.full_path(name), "rb") as f:
        return json.load(f)
