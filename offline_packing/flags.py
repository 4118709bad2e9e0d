"""The flags of `mmpack pack` (also those of `python -m offline_packing.<stage>`; auto_pipe.sh turns
LLaVA-OneVision-2's options into them), parsed in this one place into a `PackJobConfig`."""

from __future__ import annotations

import argparse
import os

from mmpack.offline_packing.config import (
    DEFAULT_MAX_RECORD_BYTES,
    ENGINES,
    IMAGE_CHECKS,
    OUTPUT_FORMATS,
    OVERLENGTH_POLICIES,
    STAGES,
    VERIFY_INPUTS,
    VIDEO_CHECKS,
    PackJobConfig,
)
from mmpack.offline_packing.model_folder import (
    RULE_FLAG_FIELDS,
    VIDEO_FLAG_FIELDS,
    resolve_chat_template,
    resolve_job_image_options,
    resolve_job_video_options,
)
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from mmpack.packing.video_tokens import VIDEO_RULE_STYLES, VideoTokenRule


def _size(text: str) -> int:
    """Bytes from '512M', '2G', '1000000'."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `mmpack pack` flags (auto_pipe.sh turns LLaVA-OneVision-2's options into these)."""
    g = p.add_argument_group("input")
    g.add_argument(
        "-i",
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="PATH",
        help="raw records: .json/.jsonl (optionally .gz), .parquet or .tar file, folder or glob, local or a URL "
        "(s3://, http(s)://, file://) (repeatable)",
    )
    g.add_argument(
        "-r",
        "--image-root",
        default=None,
        help="folder or URL (s3://, http(s)://) that image paths are relative to (default: each input file's "
        "folder)",
    )
    g.add_argument(
        "--image-check",
        choices=IMAGE_CHECKS,
        default="header",
        help="header: read sizes, decode only files whose end marker is missing (default); "
        "decode: fully decode every image",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        help=f"images with more pixels (width x height, from the header) are rejected as image_too_large "
        f"(default {DEFAULT_MAX_IMAGE_PIXELS})",
    )
    g.add_argument(
        "--max-record-bytes",
        type=_size,
        default=DEFAULT_MAX_RECORD_BYTES,
        help="records whose JSON text is longer (e.g. 8M, 1G) are rejected as record_too_large before they are "
        f"parsed or tokenized (default {DEFAULT_MAX_RECORD_BYTES >> 20}M)",
    )
    g.add_argument(
        "--verify-inputs",
        choices=VERIFY_INPUTS,
        default="stat",
        help="how a rerun tells whether an input changed: stat (path, size, mtime; default) or sha256 (content)",
    )
    g = p.add_argument_group("length model")
    g.add_argument("-L", "--seq-len", type=int, required=True, help="bin capacity in tokens")
    g.add_argument(
        "-t",
        "--tokenizer",
        default=None,
        help="tokenizer.json or a folder holding one (required unless --model); a folder also gives its chat "
        "template, and with a preprocessor_config.json the image rule, as --model does; byte-fallback: the "
        "byte-level demo tokenizer",
    )
    g.add_argument(
        "--model",
        default=None,
        metavar="DIR",
        help="HF model folder: tokenizer.json (unless -t), its chat template (chat_template.jinja, "
        "chat_template.json or tokenizer_config.json), the image rule of its preprocessor_config.json "
        "(patch, merge, temporal patch, min/max pixels, mean/std) and, for Qwen3-VL, the video rule of its "
        "video_preprocessor_config.json, recorded in the manifest",
    )
    g.add_argument(
        "--overlength",
        choices=OVERLENGTH_POLICIES,
        default="drop",
        help="samples longer than -L: drop to rejects.jsonl, truncate (whole trailing turns; "
        "never inside an image), or error",
    )
    g.add_argument("--patch-size", type=int, default=None, help="vision patch side in pixels (default 14)")
    g.add_argument(
        "--merge-size", type=int, default=None, help="patches merged per side into one token (default 2)"
    )
    g.add_argument(
        "--temporal-patch-size", type=int, default=None, help="frames per vision patch (default 2)"
    )
    g.add_argument(
        "--min-pixels", type=int, default=None, help="smart_resize lower bound on h*w (default 3136)"
    )
    g.add_argument(
        "--max-pixels", type=int, default=None, help="smart_resize upper bound on h*w (default 12845056)"
    )
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|builtin",
        help="a Jinja chat template file instead of the model folder's; builtin: mmpack's Qwen rendering "
        "(the default where the folder has no template or -t names a file)",
    )
    g.add_argument(
        "--default-system",
        default=None,
        metavar="TEXT",
        help="system prompt for records that have none (default: the chat template's own, if it has one)",
    )
    g.add_argument(
        "--no-default-system",
        action="store_true",
        help="records without a system prompt get none, even where the chat template adds a default one",
    )
    g = p.add_argument_group(
        "video rule (qwen-vl-utils, or Qwen3-VL's processor from --model DIR's video_preprocessor_config.json; "
        "patch, merge and temporal patch sizes as for images)"
    )
    d = VideoTokenRule()
    g.add_argument(
        "--video-rule",
        dest="video_rule_style",
        choices=VIDEO_RULE_STYLES,
        default=None,
        help="whose frame sampling, frame size and video tokens: qwen-vl-utils (Qwen2-VL / Qwen2.5-VL, default) "
        "or qwen3_vl (transformers' Qwen3-VL processor: timestamps before each temporal patch; the default "
        "with a Qwen3-VL --model DIR)",
    )
    g.add_argument(
        "--video-fps", type=float, default=None, help=f"frames sampled per second (default {d.fps})"
    )
    g.add_argument(
        "--video-min-frames", type=int, default=None, help=f"fewest frames sampled (default {d.min_frames})"
    )
    g.add_argument(
        "--video-max-frames", type=int, default=None, help=f"most frames sampled (default {d.max_frames})"
    )
    g.add_argument(
        "--video-min-pixels",
        type=int,
        default=None,
        help=f"smart_resize lower bound on a frame's h*w (default {d.min_pixels}); qwen3_vl: on all sampled "
        "frames' pixels together (its size.shortest_edge)",
    )
    g.add_argument(
        "--video-max-pixels",
        type=int,
        default=None,
        help=f"smart_resize upper bound on a frame's h*w (default {d.max_pixels}); qwen3_vl: on all sampled "
        "frames' pixels together (its size.longest_edge)",
    )
    g.add_argument(
        "--video-total-pixels",
        type=float,
        default=None,
        help=f"pixels all sampled frames of a video share, two frames per step (default {d.total_pixels:.0f}; "
        "qwen-vl-utils only)",
    )
    g.add_argument(
        "--video-check",
        choices=VIDEO_CHECKS,
        default="header",
        help="header: plan from container metadata, checked against the frames the decoder shows (default); "
        "decode: also decode every planned frame at pack time, as the loader will (slow; a video that fails is "
        "rejected as undecodable_video)",
    )
    g.add_argument(
        "--max-video-seconds",
        type=float,
        default=3 * 3600.0,
        help="longer videos (duration from the container) are rejected as video_too_long (default 10800)",
    )
    g = p.add_argument_group("bin packing")
    g.add_argument("-M", "--max-samples-per-bin", type=int, default=None, help="at most N samples per bin")
    g.add_argument(
        "--max-images-per-bin",
        type=int,
        default=None,
        help="at most N images per bin; samples with more are rejected",
    )
    g.add_argument("--algorithm", default="auto", help="mmpack.packing.pack_lengths algorithm (default auto)")
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
    g.add_argument(
        "--s3-endpoint", default=None, help="endpoint URL for s3:// inputs and outputs (or AWS_ENDPOINT_URL)"
    )
    g = p.add_argument_group("job")
    g.add_argument(
        "-w",
        "--workers",
        type=int,
        default=1,
        help="worker processes for scan, lengths, write (local engine; under --engine ray every chunk is a Ray "
        "task of one CPU, as many at once as the cluster has CPUs)",
    )
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="where scan, lengths and write run: local (forked workers, -w) or ray (tasks on a Ray cluster; "
        "pip install -e .[ray]); the output is the same",
    )
    g.add_argument(
        "--ray-address",
        default="auto",
        help="--engine ray: the cluster to join (default auto: the one running on this machine, else a new "
        "local one); the work folder (--work-dir) must be a URL or a filesystem every node sees (default for a URL "
        "output: <output>/_work)",
    )
    g.add_argument(
        "-S",
        "--stage",
        type=int,
        default=None,
        dest="start_stage",
        help=f"rerun from stage N ({', '.join(f'{i + 1}={s}' for i, s in enumerate(STAGES))}); "
        "default: resume, skipping completed stages",
    )
    g.add_argument(
        "--work-dir",
        default=None,
        help="folder or URL (s3://...) for stage outputs and markers (default <output>/_work; for a URL output, "
        "a local temp folder, or <output>/_work under --engine ray)",
    )
    g.add_argument(
        "--clean-work",
        action="store_true",
        help="delete the work folder's files after success (saves space; a rerun then redoes every stage); only "
        "files the job wrote there are deleted, and only in a folder that carries mmpack's marker",
    )
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="write into an output (or work folder) that is not empty and was not made by mmpack: its files "
        "named like mmpack's (manifest.json, stats.json, rejects.jsonl, shards) are replaced, nothing else "
        "is touched or deleted (default: such a folder is refused)",
    )
    g.add_argument("--chunk-size", type=int, default=2048, help="samples per unit of parallel work")
    g.add_argument(
        "--strict", action="store_true", help="fail on the first bad sample instead of rejecting it"
    )
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    g.add_argument("--debug", action="store_true", help="show the traceback of an error")


def config_from_args(args: argparse.Namespace, only_stage: int | None = None) -> PackJobConfig:
    """The job config of parsed `mmpack pack` flags; ValueError for values the config refuses."""
    storage_options = {"client_kwargs": {"endpoint_url": args.s3_endpoint}} if args.s3_endpoint else {}
    # Absolute paths: the same folder named from another working directory is the same job (fingerprints).
    model = os.path.abspath(args.model) if args.model else None
    named = args.tokenizer if args.tokenizer in (None, BYTE_TOKENIZER) else os.path.abspath(args.tokenizer)
    tokenizer, image_options = resolve_job_image_options(
        model, named, {name: getattr(args, name) for name in RULE_FLAG_FIELDS}
    )
    template_options = resolve_chat_template(model, named, args.chat_template)
    video_flags = {name: getattr(args, name) for name in VIDEO_FLAG_FIELDS}
    video_options = resolve_job_video_options(model, named, video_flags, image_options)
    return PackJobConfig(
        inputs=tuple(args.inputs),
        image_root=args.image_root,
        output=args.output,
        seq_len=args.seq_len,
        tokenizer=tokenizer or "",  # none: refused by the config with a one-line message
        max_samples_per_bin=args.max_samples_per_bin,
        max_images_per_bin=args.max_images_per_bin,
        algorithm=args.algorithm,
        seed=args.seed,
        format=args.format,
        max_bins_per_shard=args.max_bins_per_shard,
        max_shard_bytes=args.max_shard_bytes,
        workers=args.workers,
        engine=args.engine,
        ray_address=args.ray_address,
        overlength=args.overlength,
        strict=args.strict,
        **image_options,
        default_system=args.default_system,
        no_default_system=args.no_default_system,
        **template_options,
        **video_options,
        max_video_seconds=args.max_video_seconds,
        video_check=args.video_check,
        image_check=args.image_check,
        max_image_pixels=args.max_image_pixels,
        verify_inputs=args.verify_inputs,
        max_record_bytes=args.max_record_bytes,
        energon=args.energon,
        shard_prefix=args.shard_prefix,
        work_dir=args.work_dir,
        clean_work=args.clean_work,
        overwrite=args.overwrite,
        chunk_size=args.chunk_size,
        start_stage=args.start_stage,
        only_stage=only_stage,
        progress=args.progress,
        debug=args.debug,
        storage_options=storage_options,
    )


def parse_job_args(
    argv: list[str] | None, *, prog: str, description: str, only_stage: int | None = None
) -> PackJobConfig:
    """Parse `argv` into a config; bad flags or values exit with code 2 and a usage line, as argparse does."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        return config_from_args(args, only_stage)
    except ValueError as exc:
        p.error(str(exc))
