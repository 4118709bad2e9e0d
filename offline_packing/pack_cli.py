"""`mmpack pack`: flags -> PackJobConfig -> run_pack. Also the entry of `python -m offline_packing.<stage>`."""

from __future__ import annotations

import argparse
import sys

from offline_packing.config import IMAGE_CHECKS, OUTPUT_FORMATS, OVERLENGTH_POLICIES, STAGES, PackJobConfig
from offline_packing.errors import PackError


def _size(text: str) -> int:
    """Bytes from '512M', '2G', '1000000'."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `mmpack pack` flags (auto_pipe.sh uses the same short ones)."""
    g = p.add_argument_group("input")
    g.add_argument(
        "-i",
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="PATH",
        help="raw records: .json/.jsonl/.parquet file, folder or glob (repeatable)",
    )
    g.add_argument(
        "-r",
        "--image-root",
        default=None,
        help="folder that image paths are relative to (default: each input file's folder)",
    )
    g.add_argument(
        "--image-check",
        choices=IMAGE_CHECKS,
        default="header",
        help="header: read sizes, decode only files whose end marker is missing (default); "
        "decode: fully decode every image",
    )
    g = p.add_argument_group("length model")
    g.add_argument("-L", "--seq-len", type=int, required=True, help="bin capacity in tokens")
    g.add_argument(
        "-t",
        "--tokenizer",
        default=None,
        help="tokenizer.json or a folder holding one (default: byte-level demo fallback)",
    )
    g.add_argument(
        "--overlength",
        choices=OVERLENGTH_POLICIES,
        default="drop",
        help="samples longer than -L: drop to rejects.jsonl, truncate (whole trailing turns; "
        "never inside an image), or error",
    )
    g.add_argument("--patch-size", type=int, default=14, help="vision patch side in pixels (default 14)")
    g.add_argument(
        "--merge-size", type=int, default=2, help="patches merged per side into one token (default 2)"
    )
    g.add_argument(
        "--min-pixels", type=int, default=3136, help="smart_resize lower bound on h*w (default 3136)"
    )
    g.add_argument("--max-pixels", type=int, default=12845056, help="smart_resize upper bound on h*w")
    g.add_argument("--default-system", default=None, help="system prompt for records that have none")
    g = p.add_argument_group("bin packing")
    g.add_argument("-M", "--max-samples-per-bin", type=int, default=None, help="at most N samples per bin")
    g.add_argument(
        "--max-images-per-bin",
        type=int,
        default=None,
        help="at most N images per bin; samples with more are rejected",
    )
    g.add_argument("--algorithm", default="auto", help="packing.pack_lengths algorithm (default auto)")
    g.add_argument("--seed", type=int, default=0, help="seed of the order of bins in the shards (default 0)")
    g = p.add_argument_group("output")
    g.add_argument("-o", "--output", required=True, help="output folder or fsspec URL (s3://bucket/prefix)")
    g.add_argument(
        "-f", "--format", choices=OUTPUT_FORMATS, default="arrow", help="shard format(s) (default arrow)"
    )
    g.add_argument(
        "--max-bins-per-shard", type=int, default=1024, help="bins per shard at most (default 1024)"
    )
    g.add_argument(
        "--max-shard-bytes",
        type=_size,
        default=256 * 2**20,
        help="estimated size cap per shard, e.g. 512M, 2G (default 256M)",
    )
    g.add_argument(
        "--shard-prefix", default="packed", help="shard and bin key prefix: letters, digits, _ and -"
    )
    g.add_argument(
        "--energon",
        action="store_true",
        help="also write .nv-meta so Megatron-Energon reads the WebDataset shards",
    )
    g.add_argument("--s3-endpoint", default=None, help="endpoint URL for s3:// outputs (or AWS_ENDPOINT_URL)")
    g = p.add_argument_group("job")
    g.add_argument("-w", "--workers", type=int, default=1, help="worker processes for scan, lengths, write")
    g.add_argument(
        "-S",
        "--stage",
        type=int,
        default=None,
        dest="start_stage",
        help=f"rerun from stage N ({', '.join(f'{i + 1}={s}' for i, s in enumerate(STAGES))}); "
        "default: resume, skipping completed stages",
    )
    g.add_argument("--work-dir", default=None, help="local folder for stage outputs (default <output>/_work)")
    g.add_argument(
        "--clean-work",
        action="store_true",
        help="delete the work folder after success (saves space; a rerun then redoes every stage)",
    )
    g.add_argument("--chunk-size", type=int, default=2048, help="samples per unit of parallel work")
    g.add_argument(
        "--strict", action="store_true", help="fail on the first bad sample instead of rejecting it"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")


def config_from_args(args: argparse.Namespace, only_stage: int | None = None) -> PackJobConfig:
    storage_options = {"client_kwargs": {"endpoint_url": args.s3_endpoint}} if args.s3_endpoint else {}
    return PackJobConfig(
        inputs=tuple(args.inputs),
        image_root=args.image_root,
        output=args.output,
        seq_len=args.seq_len,
        tokenizer=args.tokenizer,
        max_samples_per_bin=args.max_samples_per_bin,
        max_images_per_bin=args.max_images_per_bin,
        algorithm=args.algorithm,
        seed=args.seed,
        format=args.format,
        max_bins_per_shard=args.max_bins_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        workers=args.workers,
        overlength=args.overlength,
        strict=args.strict,
        patch_size=args.patch_size,
        merge_size=args.merge_size,
        min_pixels=args.min_pixels,
        max_pixels=args.max_pixels,
        default_system=args.default_system,
        image_check=args.image_check,
        energon=args.energon,
        shard_prefix=args.shard_prefix,
        work_dir=args.work_dir,
        clean_work=args.clean_work,
        chunk_size=args.chunk_size,
        start_stage=args.start_stage,
        only_stage=only_stage,
        progress=args.progress,
        storage_options=storage_options,
    )


def run(args: argparse.Namespace, only_stage: int | None = None) -> int:
    """Run the job; prints the summary to stderr. Exit code 0 on success, 1 on a job error, 2 on bad flags."""
    from offline_packing.pipeline import run_pack

    try:
        cfg = config_from_args(args, only_stage)
    except ValueError as exc:
        print(f"mmpack pack: error: {exc}", file=sys.stderr)
        return 2
    try:
        summary = run_pack(cfg)
    except (PackError, FileNotFoundError, ValueError) as exc:
        print(f"mmpack pack: error: {exc}", file=sys.stderr)
        return 1
    if summary.stage_seconds or summary.stages_skipped:
        print(summary.format_table(), file=sys.stderr)
    return 0


def main_for_stage(stage: int, argv: list[str] | None = None) -> int:
    """`python -m offline_packing.<stage> <mmpack pack flags>`: run that stage only."""
    name = STAGES[stage - 1]
    p = argparse.ArgumentParser(
        prog=f"python -m offline_packing.{name}",
        description=f"stage {stage} ({name}) of `mmpack pack`; same flags",
    )
    add_arguments(p)
    return run(p.parse_args(argv), only_stage=stage)
