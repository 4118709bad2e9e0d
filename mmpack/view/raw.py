"""`mmpack view RAW... -n N`: the first N records of raw inputs, packed by the offline job itself (`mmpack pack`:
its reader, length model, chat template and image rules, with the model folder given), so that the page shows
what a full pack would make of them, without packing the whole input. `mmpack pack ... --preview N` does the same
with that job's own flags (`mmpack.view.cli.run_pack_preview`).

The inputs are what `mmpack pack -i` takes (files, folders, globs, URLs; JSON, JSON Lines, their gzip forms,
Parquet, WebDataset tars), expanded by the job's own `expand_inputs` into the files a full pack reads, in its
order. The first N records are those of the first files, in the job's order: each file that holds some of them
is copied into the preview's work folder, cut after its last one and in its own form (a JSON Lines prefix, a JSON
array closed after the element, the first Parquet rows, the first tar samples with their members), so that the
job's reader gives the same records at the same lines, and so the same sample ids (the copy's path is shown as
the original's).
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import tarfile
from pathlib import Path
from typing import IO

from mmpack.offline_packing import pack_cli
from mmpack.offline_packing.config import DEFAULT_MAX_RECORD_BYTES
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.inputs.chunks import input_kind
from mmpack.offline_packing.inputs.json_lines import iter_lines, reading
from mmpack.offline_packing.inputs.json_records import parse_json_document
from mmpack.offline_packing.inputs.remote import is_url
from mmpack.offline_packing.inputs.sources import expand_inputs, input_folder
from mmpack.offline_packing.tar_source import index_tar


def first_records(
    inputs: list[str], n: int, dest_dir: Path, storage_options: dict | None = None
) -> dict[str, str]:
    """Copies of the input files that hold the first `n` records of `inputs` (as `mmpack pack -i` takes them),
    each cut after its last one of them, in `dest_dir/<k>/<its name>`; returns {copy: original file}, in the
    job's order of the files."""
    ctx = JobContext(work_dir="", storage_options=storage_options or {})
    dest_dir = Path(os.path.abspath(dest_dir))  # the job names its inputs by absolute path (`expand_inputs`)
    copies: dict[str, str] = {}
    left = n
    for k, path in enumerate(expand_inputs(ctx.remote, inputs)):
        if left == 0:
            break
        dest = dest_dir / str(k) / path.rstrip("/").rsplit("/", 1)[-1]
        dest.parent.mkdir(parents=True, exist_ok=True)
        taken = _copy_head(ctx, path, left, dest)
        if taken:
            copies[str(dest)] = path
            left -= taken
    return copies


def _copy_head(ctx: JobContext, path: str, want: int, dest: Path) -> int:
    """Write the first `want` records of input file `path` to `dest`, in its form; returns how many it holds."""
    kind = input_kind(ctx, path, DEFAULT_MAX_RECORD_BYTES)
    if kind == "parquet":
        return _parquet_head(ctx, path, want, dest)
    if kind == "tar":
        return _tar_head(ctx, path, want, dest)
    if kind in ("lines", "gzip-lines"):
        with reading(ctx.remote, path) as f:
            cut, taken = _lines_cut(f, want)
        with reading(ctx.remote, path) as f:
            data = f.read(cut) if cut is not None else f.read()
        return _write(dest, data, path, taken)
    # a JSON document: an array, one object, or JSONL that sniffing did not take for it
    with reading(ctx.remote, path) as f:
        data = f.read()
    text = data.decode("utf-8-sig", errors="surrogateescape")
    if text.lstrip(" \t\r\n").startswith("["):
        at, taken = _end_of_records(text, want, path)
        return _write(dest, (text[:at] + "\n]\n").encode("utf-8", "surrogateescape"), path, taken)
    if len(parse_json_document(data)) <= 1:
        return _write(dest, data, path, 1 if text.strip() else 0)
    cut, taken = _lines_cut(io.BytesIO(data), want)
    return _write(dest, data[:cut] if cut is not None else data, path, taken)


def _lines_cut(f: IO[bytes], want: int) -> tuple[int | None, int]:
    """(where record `want` + 1 starts, or None at the end; records before it) of JSON Lines `f`, by the job's
    own line reader (blank lines are no records, and stay in the copy, so the line numbers do not move)."""
    taken = 0
    for line in iter_lines(f, DEFAULT_MAX_RECORD_BYTES):
        if taken == want:
            return line.offset, taken
        taken += 1
    return None, taken


def _write(dest: Path, data: bytes, path: str, taken: int) -> int:
    dest.write_bytes(gzip.compress(data, mtime=0) if path.endswith(".gz") else data)
    return taken


def _parquet_head(ctx: JobContext, path: str, want: int, dest: Path) -> int:
    """The first `want` rows of a Parquet file, its schema kept (a row's number is its line)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = io.BytesIO(ctx.remote.read_all(path)) if is_url(path) else path
    try:
        with pq.ParquetFile(source) as parquet:
            rows = min(want, parquet.metadata.num_rows)
            batches = parquet.iter_batches(batch_size=max(rows, 1))
            table = pa.Table.from_batches([next(batches)] if rows else [], schema=parquet.schema_arrow)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise ValueError(
            f"{path}: not a Parquet file pyarrow can read ({' '.join(str(exc).split())})"
        ) from None
    pq.write_table(table.slice(0, rows), dest)
    return rows


def _tar_head(ctx: JobContext, path: str, want: int, dest: Path) -> int:
    """The first `want` samples of a WebDataset tar, every member of each (images too), in the tar's order."""
    samples = index_tar(ctx, path)[:want]
    with ctx.remote.open_binary(path) as f, tarfile.open(dest, "w") as out:
        for sample in samples:
            for suffix, (offset, size) in sample.members.items():
                f.seek(offset)
                info = tarfile.TarInfo(f"{sample.key}.{suffix}" if suffix else sample.key)
                info.size = size
                out.addfile(info, io.BytesIO(f.read(size)))
    return len(samples)


def _end_of_records(text: str, n: int, src: str) -> tuple[int, int]:
    """(where the `n`-th element of the JSON array `text` ends, or its last one when it holds fewer; how many
    elements that is)."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    end, taken = at, 0
    for _ in range(n):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        try:
            _, at = decoder.raw_decode(text, at)
        except ValueError as e:
            raise ValueError(f"{src}: not valid JSON ({e})") from None
        end, taken = at, taken + 1
    return end, taken


def pack_preview(args: argparse.Namespace, work: Path) -> tuple[Path, str | None, dict[str, str]]:
    """Pack the first `args.records` records of `args.path` (inputs as `mmpack pack -i` takes them) into
    `work/dataset` with `mmpack pack`; returns the dataset, the tokenizer to show it with, and {copy's path:
    original path} for the sample ids."""
    paths = list(args.path) if isinstance(args.path, (list, tuple)) else [args.path]
    named = " ".join(paths)
    n = args.records or 10
    job = getattr(args, "pack_job", None)  # `mmpack pack --preview N`: that job's own flags
    endpoint = getattr(job if job is not None else args, "s3_endpoint", None)
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    copies = first_records(paths, n, work / "input", options)
    if not copies:
        raise ValueError(f"{named}: no records to preview")
    image_root = _image_root(args.image_root, list(copies.values()))
    dataset = work / "dataset"
    argv = [arg for copy in copies for arg in ("-i", copy)] + ["-r", image_root]
    argv += ["-L", str(args.seq_len), "-o", str(dataset), "--overwrite", "--no-progress", "-w", "1"]
    argv += ["--s3-endpoint", endpoint] if endpoint else []
    if args.model:
        argv += ["--model", args.model]
    if args.tokenizer:
        argv += ["-t", args.tokenizer]
    argv += list(args.pack_arg)
    copied = list(copies)
    code = (
        pack_cli.main(argv) if job is None else pack_cli.run(_preview_job(job, copied, dataset, image_root))
    )
    if code != 0:
        raise ValueError(
            f"{named}: packing the first {n} records failed (mmpack pack exit {code}, see above)"
        )
    tokenizer = args.tokenizer or args.model
    return dataset, tokenizer, copies


def _image_root(given: str | None, originals: list[str]) -> str:
    """The image root of the copies: the one given, else the folder of the original files (a full pack's
    default is each file's own folder: one folder for all of them, or no image paths (tars), is needed)."""
    if given:
        return given if is_url(given) else str(Path(given).resolve())
    folders = sorted({input_folder(p) for p in originals if not p.endswith(".tar")})
    if len(folders) > 1:
        raise ValueError(
            f"the first records come from files in {len(folders)} folders ({', '.join(folders[:3])}), and image "
            "paths are relative to each file's folder: give -r/--image-root, or preview one folder's files"
        )
    return folders[0] if folders else input_folder(originals[0])


# flags of a `mmpack pack --preview` job that the small pack of its first records does not take
_NOT_FOR_PREVIEW = ("preview", "work_dir", "start_stage", "engine", "ray_address", "clean_work", "energon")


def _preview_job(
    job: argparse.Namespace, copies: list[str], dataset: Path, image_root: str
) -> argparse.Namespace:
    """The flags of `job` (parsed `mmpack pack` flags) for packing the copy of its first records into `dataset`:
    its length model, template and rules as given; local, one worker, no progress bars."""
    flags = {k: v for k, v in vars(job).items() if k not in _NOT_FOR_PREVIEW}
    flags |= {"inputs": copies, "output": str(dataset), "image_root": image_root}
    flags |= {"overwrite": True, "progress": False, "workers": 1}
    return argparse.Namespace(**flags)
