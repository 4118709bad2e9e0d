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

from mmpack.offline_packing.config import STAGES, PackJobConfig, PackSummary
from mmpack.offline_packing.errors import PackError, describe_failure
from mmpack.offline_packing.fingerprint import identities, stage_fingerprint
from mmpack.offline_packing.job_folders import JobFolders
from mmpack.offline_packing.storage import OutputStore
from mmpack.offline_packing.workdir import WorkDir
from mmpack.packing.format import MANIFEST_NAME, STATS_NAME
from mmpack.packing.manifest import Manifest
from mmpack.packing.ownership import OwnedFolder


def resolve_work_dir(cfg: PackJobConfig) -> str:
    """The work folder of a job (a local path or a URL): `work_dir_of` its output, work dir and engine."""
    return work_dir_of(cfg.output, cfg.work_dir, cfg.engine, cfg.storage_options)


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


def _fingerprint(cfg: PackJobConfig, stage: str, previous: str, files: list[str]) -> str:
    """The fingerprint `stage` has now, after a stage whose output fingerprint is `previous`."""
    inputs: list[str] = []
    if stage == "scan":
        inputs = files
    elif stage == "lengths":
        from mmpack.packing.tokenizer import tokenizer_files

        inputs = tokenizer_files(cfg.tokenizer)
    return stage_fingerprint(stage, cfg.stage_config(stage), previous, identities(inputs, cfg.verify_inputs))


def _completed(cfg: PackJobConfig, wd: WorkDir, stage: str, fingerprint: str) -> str | None:
    """The output fingerprint of `stage` if it completed with `fingerprint` and is still current, else None."""
    if stage == "scan":
        from mmpack.offline_packing.scan import scan_output_fingerprint

        return scan_output_fingerprint(wd, fingerprint, cfg.verify_inputs)
    if not wd.is_done(stage, fingerprint) or not _outputs_present(cfg, stage):
        return None
    return fingerprint


def _run_stage(
    cfg: PackJobConfig, wd: WorkDir, stage: str, fingerprint: str, files: list[str], output: OwnedFolder
) -> str:
    """Run `stage`; returns its output fingerprint (what the next stage builds on)."""
    if stage == "scan":
        from mmpack.offline_packing.scan import run_scan

        info = run_scan(
            cfg.stage_config("scan"), files, wd, fingerprint, workers=cfg.workers, progress=cfg.progress
        )
        return str(info["output_fingerprint"])
    if stage == "lengths":
        from mmpack.offline_packing.lengths import get_tokenizer, run_lengths

        get_tokenizer(cfg.tokenizer)  # loaded once here; forked workers inherit it
        run_lengths(cfg.stage_config("lengths"), wd, fingerprint, workers=cfg.workers, progress=cfg.progress)
    elif stage == "binpack":
        from mmpack.offline_packing.binpack import run_binpack

        run_binpack(cfg.stage_config("binpack"), wd, fingerprint)
    else:
        _run_write(cfg, wd, fingerprint, output)
    return fingerprint


def _run_write(cfg: PackJobConfig, wd: WorkDir, fingerprint: str, output: OwnedFolder) -> None:
    from mmpack.offline_packing.finalize import finalize
    from mmpack.offline_packing.write import (
        record_previous_dataset,
        remove_unlisted_outputs,
        run_write_shards,
    )

    write_cfg = cfg.stage_config("write")
    store = OutputStore(cfg.output, cfg.storage_options, staging_dir=wd.stage_dir("write"))
    if not output.created:  # a folder adopted now (--overwrite): its old manifest lists the user's files
        record_previous_dataset(store, wd)
    store.remove(MANIFEST_NAME)  # the dataset is uncommitted while its shards are (re)written
    shards = run_write_shards(
        write_cfg,
        cfg.storage_options,
        wd,
        fingerprint,
        workers=cfg.workers,
        progress=cfg.progress,
    )
    finalize(cfg, wd, shards)
    remove_unlisted_outputs(output, wd, write_cfg, shards)
    wd.mark_done("write", fingerprint, {})


def _clear_chunk_markers(wd: WorkDir, stage: str) -> None:
    wd.remove(f"{stage}/*.done.json")
    wd.remove(f"{stage}/shard-*.json")


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
    from mmpack.offline_packing.engines import use_engine
    from mmpack.offline_packing.inputs import remote

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from mmpack.packing.tokenizer import tokenizer_files

    tokenizer_files(cfg.tokenizer)  # a missing tokenizer fails before the first stage, not after it
    if cfg.energon:
        from mmpack.offline_packing.outputs.energon_meta import require_energon

        require_energon()
    remote.configure(cfg.storage_options)  # inputs (s3://...) are read with the output's storage options
    with use_engine(cfg.engine, cfg.ray_address):
        return _run_stages(cfg)


def _run_stages(cfg: PackJobConfig) -> PackSummary:
    from mmpack.offline_packing import workdir
    from mmpack.offline_packing.inputs.sources import expand_inputs
    from mmpack.offline_packing.job_folders import claim_job_folders, remove_work_files

    work_address = resolve_work_dir(cfg)
    with claim_job_folders(cfg, work_address) as folders:
        files = expand_inputs(cfg.inputs, exclude=(cfg.output, work_address))  # never the job's own files
        workdir.start_run()  # a URL work folder starts from an empty local cache: nothing stale is read
        wd = WorkDir(work_address)
        wd.root.mkdir(parents=True, exist_ok=True)
        try:
            summary = _run_stages_in(cfg, files, wd, folders)
        finally:
            wd.close()
        clean = cfg.clean_work and "write" in (*summary.stage_seconds, *summary.stages_skipped)
        if clean:
            remove_work_files(folders.work)
    if clean:
        folders.work.release()  # its marker and the folder, once the lock file is gone too
    return summary


def _run_stages_in(cfg: PackJobConfig, files: list[str], wd: WorkDir, folders: JobFolders) -> PackSummary:
    first = cfg.only_stage or cfg.start_stage or 1
    last = cfg.only_stage or len(STAGES)
    summary = PackSummary(output=cfg.output)
    forced = cfg.only_stage is not None or cfg.start_stage is not None
    previous, redo_rest, wrote = "", False, False
    for n, name in enumerate(STAGES[:last], start=1):
        fingerprint = _fingerprint(cfg, name, previous, files)
        completed = _completed(cfg, wd, name, fingerprint)
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
            _clear_chunk_markers(wd, name)
        start = time.perf_counter()
        previous = _run_stage(cfg, wd, name, fingerprint, files, folders.output)
        summary.stage_seconds[name] = time.perf_counter() - start
        wrote = name == "write"
    if wrote:
        _fill_summary(summary, cfg)
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
        if cfg.debug:
            traceback.print_exc()
        print(f"{command}: error: {describe_failure(exc)}", file=sys.stderr)
        return 1
    if summary.stage_seconds or summary.stages_skipped:
        print(summary.format_table(), file=sys.stderr)
    return 0


def stage_main(stage: str, argv: list[str] | None = None) -> int:
    """`python -m offline_packing.<stage> <mmpack pack flags>`: run that stage only."""
    from mmpack.offline_packing.flags import parse_job_args

    n = STAGES.index(stage) + 1
    prog = f"python -m offline_packing.{stage}"
    cfg = parse_job_args(argv, prog=prog, description=f"stage {n} ({stage}) of `mmpack pack`", only_stage=n)
    return run_pack_reporting(cfg, prog)


def _outputs_present(cfg: PackJobConfig, stage: str) -> bool:
    """The write stage also needs its manifest to still be in the output (it may have been deleted)."""
    if stage != "write":
        return True
    return OutputStore(cfg.output, cfg.storage_options).size(MANIFEST_NAME) is not None


def _fill_summary(summary: PackSummary, cfg: PackJobConfig) -> None:
    from mmpack.offline_packing.finalize import fill_efficiency

    store = OutputStore(cfg.output, cfg.storage_options)
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
