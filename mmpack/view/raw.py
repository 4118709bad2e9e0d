"""`mmpack view RAW -n N`: the first N records of a raw file, packed by the offline job itself (`mmpack pack`: its
reader, length model, chat template and image rules, with the model folder given), so that the page shows what a
full pack would make of them, without packing the whole file. `mmpack pack ... --preview N` does the same with
that job's own flags (`mmpack.view.cli.run_pack_preview`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mmpack.offline_packing import pack_cli

_SUFFIXES = (".json", ".jsonl")


def first_records(src: Path, n: int, dest_dir: Path) -> Path:
    """Copy the first `n` records of `src` (a JSON array or JSON lines) into `dest_dir`, same name and form, so
    that their lines (and so their sample ids) are the ones a full pack gives; returns the copy."""
    if src.suffix not in _SUFFIXES or not src.is_file():
        raise ValueError(f"{src}: the raw preview reads one local .json or .jsonl file; give one")
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / src.name
    with src.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        text = src.read_text(encoding="utf-8-sig")
        dest.write_text(text[: _end_of_records(text, n, src)] + "\n]\n", encoding="utf-8")
        return dest
    lines: list[bytes] = []
    with src.open("rb") as f:
        for line in f:
            lines.append(line)
            if sum(1 for x in lines if x.strip()) == n:
                break
    dest.write_bytes(b"".join(lines))
    return dest


def _end_of_records(text: str, n: int, src: Path) -> int:
    """Where the `n`-th element of the JSON array `text` ends (or its last one, when it holds fewer)."""
    decoder = json.JSONDecoder()
    at = text.index("[") + 1
    for _ in range(n):
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        try:
            _, at = decoder.raw_decode(text, at)
        except ValueError as e:
            raise ValueError(f"{src}: not valid JSON ({e})") from None
    return at


def pack_preview(args: argparse.Namespace, work: Path) -> tuple[Path, str | None, dict[str, str]]:
    """Pack the first `args.records` records of `args.path` into `work/dataset` with `mmpack pack`; returns the
    dataset, the tokenizer to show it with, and {copy's path: original path} for the sample ids."""
    src = Path(args.path).resolve()
    n = args.records or 10
    copy = first_records(src, n, work / "input")
    dataset = work / "dataset"
    image_root = str(Path(args.image_root or src.parent).resolve())
    argv = ["-i", str(copy), "-r", image_root]
    argv += ["-L", str(args.seq_len), "-o", str(dataset), "--overwrite", "--no-progress", "-w", "1"]
    if args.model:
        argv += ["--model", args.model]
    if args.tokenizer:
        argv += ["-t", args.tokenizer]
    argv += list(args.pack_arg)
    job = getattr(args, "pack_job", None)  # `mmpack pack --preview N`: that job's own flags
    code = pack_cli.main(argv) if job is None else pack_cli.run(_preview_job(job, copy, dataset, image_root))
    if code != 0:
        raise ValueError(f"{src}: packing its first {n} records failed (mmpack pack exit {code}, see above)")
    tokenizer = args.tokenizer or args.model
    return dataset, tokenizer, {str(copy): str(src)}


# flags of a `mmpack pack --preview` job that the small pack of its first records does not take
_NOT_FOR_PREVIEW = ("preview", "work_dir", "start_stage", "engine", "ray_address", "clean_work", "energon")


def _preview_job(job: argparse.Namespace, copy: Path, dataset: Path, image_root: str) -> argparse.Namespace:
    """The flags of `job` (parsed `mmpack pack` flags) for packing the copy of its first records into `dataset`:
    its length model, template and rules as given; local, one worker, no progress bars."""
    flags = {k: v for k, v in vars(job).items() if k not in _NOT_FOR_PREVIEW}
    flags |= {"inputs": [str(copy)], "output": str(dataset), "image_root": image_root}
    flags |= {"overwrite": True, "progress": False, "workers": 1}
    return argparse.Namespace(**flags)
