"""The offline packing job: scan -> lengths -> binpack -> write, each stage resumable.

`run_pack(PackJobConfig(...)) -> PackSummary` is the Python API; `mmpack pack`, `auto_pipe.sh` and
`python -m offline_packing.<stage>` all end here. A stage whose marker records the same options is skipped
(resume); `-S N` reruns from stage N, which needs stages 1..N-1 complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from offline_packing.config import STAGES, PackJobConfig, PackSummary
from offline_packing.errors import PackError
from offline_packing.storage import OutputStore
from offline_packing.workdir import WorkDir
from packing.format import MANIFEST_NAME, STATS_NAME
from packing.manifest import Manifest


def resolve_work_dir(cfg: PackJobConfig) -> Path:
    """The local work folder: --work-dir, else `<output>/_work` for a local output, else a temp folder
    named after the output URL (so a rerun finds it)."""
    if cfg.work_dir is not None:
        return Path(cfg.work_dir)
    store = OutputStore(cfg.output, cfg.storage_options)
    if store.is_local:
        return store.local_path("_work")
    digest = hashlib.sha256(cfg.output.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"mmpack-work-{digest}"


def _run_scan(cfg: PackJobConfig, wd: WorkDir) -> None:
    from offline_packing.scan import run_scan

    run_scan(cfg, wd)


def _run_lengths(cfg: PackJobConfig, wd: WorkDir) -> None:
    from offline_packing.lengths import run_lengths

    run_lengths(cfg, wd)


def _run_binpack(cfg: PackJobConfig, wd: WorkDir) -> None:
    from offline_packing.binpack import run_binpack

    run_binpack(cfg, wd)


def _run_write(cfg: PackJobConfig, wd: WorkDir) -> None:
    from offline_packing.finalize import finalize
    from offline_packing.write import run_write_shards

    store = OutputStore(cfg.output, cfg.storage_options, staging_dir=wd.stage_dir("write"))
    store.remove(MANIFEST_NAME)  # the dataset is uncommitted while its shards are (re)written
    finalize(cfg, wd, run_write_shards(cfg, wd))
    wd.mark_done("write", cfg.stage_fingerprint(4), {})


STAGE_FUNCTIONS: dict[str, Callable[[PackJobConfig, WorkDir], None]] = {
    "scan": _run_scan,
    "lengths": _run_lengths,
    "binpack": _run_binpack,
    "write": _run_write,
}


def _clear_chunk_markers(wd: WorkDir, stage: str) -> None:
    d = wd.root / stage
    if d.is_dir():
        for p in d.glob("*.done.json"):
            p.unlink()
        for p in d.glob("shard-*.json"):
            p.unlink()


def run_pack(cfg: PackJobConfig) -> PackSummary:
    """Run the packing job described by `cfg`; returns its summary.

    Raises:
        PackError: a `--strict` reject, `--overlength error`, or `-S N` without stages 1..N-1 complete.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if cfg.tokenizer is not None:  # fail before the first stage, not after it
        from packing.tokenizer import resolve_tokenizer_file

        resolve_tokenizer_file(cfg.tokenizer)
    wd = WorkDir(resolve_work_dir(cfg))
    wd.root.mkdir(parents=True, exist_ok=True)
    first = cfg.only_stage or cfg.start_stage or 1
    last = cfg.only_stage or len(STAGES)
    for n in range(1, first):
        if not wd.is_done(STAGES[n - 1], cfg.stage_fingerprint(n)):
            raise PackError(
                f"cannot start at stage {first} ({STAGES[first - 1]}): stage {n} ({STAGES[n - 1]}) has not "
                f"completed with these options in {wd.root}; run the earlier stages first (or the whole job "
                "without -S)"
            )
    summary = PackSummary(output=cfg.output)
    forced = cfg.only_stage is not None or cfg.start_stage is not None
    redo_rest = False
    for n in range(first, last + 1):
        name = STAGES[n - 1]
        fingerprint = cfg.stage_fingerprint(n)
        if not (forced or redo_rest) and wd.is_done(name, fingerprint) and _outputs_present(cfg, name):
            summary.stages_skipped.append(name)
            continue
        redo_rest = True  # every later stage depends on this one
        wd.clear_marker(name)
        if forced:
            _clear_chunk_markers(wd, name)
        start = time.perf_counter()
        STAGE_FUNCTIONS[name](cfg, wd)
        summary.stage_seconds[name] = time.perf_counter() - start
    if wd.is_done("write", cfg.stage_fingerprint(4)):
        _fill_summary(summary, cfg)
        if cfg.clean_work:
            import shutil

            shutil.rmtree(wd.root)
    return summary


def _outputs_present(cfg: PackJobConfig, stage: str) -> bool:
    """The write stage also needs its manifest to still be in the output (it may have been deleted)."""
    if stage != "write":
        return True
    return OutputStore(cfg.output, cfg.storage_options).size(MANIFEST_NAME) is not None


def _fill_summary(summary: PackSummary, cfg: PackJobConfig) -> None:
    from offline_packing.finalize import fill_efficiency

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
    summary.shards = [e.to_dict() for e in manifest.shards]
    summary.output_bytes = sum(e.bytes for e in manifest.shards)
    summary.fill_efficiency = fill_efficiency(stats)


def read_manifest(output: str, storage_options: dict | None = None) -> dict:
    """The manifest of a packed dataset as plain JSON values, checked by `packing.manifest.Manifest`."""
    return _read_output_manifest(OutputStore(output, storage_options)).to_dict()


def _read_output_manifest(store: OutputStore) -> Manifest:
    with store.fs.open(store.full_path(MANIFEST_NAME), "rb") as f:
        return Manifest.from_json(f.read(), source=store.full_path(MANIFEST_NAME))


def _read_output_json(store: OutputStore, name: str) -> dict:
    with store.fs.open(store.full_path(name), "rb") as f:
        return json.load(f)
