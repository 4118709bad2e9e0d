"""The flags of `mmpack pack` (also those of `python -m offline_packing.<stage>`; auto_pipe.sh turns
LLaVA-OneVision-2's options into them), parsed in this one place into a `PackJobConfig`.

Each flag sets the option of its name (`mmpack.offline_packing.options`: `--video-fps` sets `video_fps`), and a
flag not given leaves its option to the config's default. Three flags are resolved first: `--model` (and `-t`
naming a model folder) into the tokenizer, the image and video rules and the chat template (`model_folder`;
the video flags `--video-*` and `--video-rule` are checked against a Qwen3-VL folder's video processor),
`--chat-template` into the chat template, `--s3-endpoint` into the storage options.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from mmpack.offline_packing.config import (
    CODEC_GROUPINGS,
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
    resolve_image_rule,
    resolve_video_rule,
)
from mmpack.offline_packing.options import job_config, option_default
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from mmpack.packing.video_rules import style_names


def _size(text: str) -> int:
    """Bytes from '512M', '2G', '1000000'."""
    units = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def _add(group: argparse._ArgumentGroup, *names: str, **kw: Any) -> None:
    """A flag whose absence leaves its option to the config's default (`mmpack.offline_packing.options`)."""
    group.add_argument(*names, default=argparse.SUPPRESS, **kw)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """All `mmpack pack` flags (auto_pipe.sh turns LLaVA-OneVision-2's options into these)."""
    g = p.add_argument_group("input")
    _add(
        g,
        "-i",
        "--input",
        dest="inputs",
        action="append",
        required=True,
        metavar="PATH",
        help="raw records: .json/.jsonl (optionally .gz), .parquet or .tar file, folder or glob, local or a URL "
        "(s3://, http(s)://, file://) (repeatable)",
    )
    _add(
        g,
        "-r",
        "--image-root",
        help="folder or URL (s3://, http(s)://) that image paths are relative to (default: each input file's "
        "folder)",
    )
    _add(
        g,
        "--image-check",
        choices=IMAGE_CHECKS,
        help="header: read sizes, decode only files whose end marker is missing (default); "
        "decode: fully decode every image",
    )
    _add(
        g,
        "--max-image-pixels",
        type=int,
        help=f"images with more pixels (width x height, from the header) are rejected as image_too_large "
        f"(default {option_default('max_image_pixels')})",
    )
    _add(
        g,
        "--max-record-bytes",
        type=_size,
        help="records whose JSON text is longer (e.g. 8M, 1G) are rejected as record_too_large before they are "
        f"parsed or tokenized (default {option_default('max_record_bytes') >> 20}M)",
    )
    _add(
        g,
        "--verify-inputs",
        choices=VERIFY_INPUTS,
        help="how a rerun tells whether an input changed: stat (path, size, mtime; default) or sha256 (content)",
    )
    g = p.add_argument_group("length model")
    _add(g, "-L", "--seq-len", type=int, required=True, help="bin capacity in tokens")
    _add(
        g,
        "-t",
        "--tokenizer",
        help="tokenizer.json or a folder holding one (required unless --model); a folder also gives its chat "
        "template, and with a preprocessor_config.json the image rule, as --model does; byte-fallback: the "
        "byte-level demo tokenizer",
    )
    _add(
        g,
        "--model",
        metavar="DIR",
        help="HF model folder: tokenizer.json (unless -t), its chat template (chat_template.jinja, "
        "chat_template.json or tokenizer_config.json), the image rule of its preprocessor_config.json "
        "(patch, merge, temporal patch, min/max pixels, mean/std) and, for Qwen3-VL, the video rule of its "
        "video_preprocessor_config.json, recorded in the manifest",
    )
    _add(
        g,
        "--overlength",
        choices=OVERLENGTH_POLICIES,
        help="samples longer than -L: drop to rejects.jsonl, truncate (whole trailing turns; "
        "never inside an image), or error",
    )
    for name, what in (
        ("patch_size", "vision patch side in pixels"),
        ("merge_size", "patches merged per side into one token"),
        ("temporal_patch_size", "frames per vision patch"),
        ("min_pixels", "smart_resize lower bound on h*w (over --model's too)"),
        ("max_pixels", "smart_resize upper bound on h*w (over --model's too)"),
    ):
        _add(g, f"--{name.replace('_', '-')}", type=int, help=f"{what} (default {option_default(name)})")
    _add(
        g,
        "--chat-template",
        dest="chat_template_file",
        metavar="FILE|builtin",
        help="a Jinja chat template file instead of the model folder's; builtin: mmpack's Qwen rendering "
        "(the default where the folder has no template or -t names a file)",
    )
    _add(
        g,
        "--default-system",
        dest="chat_default_system",
        metavar="TEXT",
        help="system prompt for records that have none (default: the chat template's own, if it has one)",
    )
    _add(
        g,
        "--no-default-system",
        dest="chat_no_default_system",
        action="store_true",
        help="records without a system prompt get none, even where the chat template adds a default one",
    )
    g = p.add_argument_group(
        "video rule (qwen-vl-utils, Qwen3-VL's processor from --model DIR's video_preprocessor_config.json, or "
        "LLaVA-OneVision-2's from a OneVision-2 --model DIR; "
        "patch, merge and temporal patch sizes as for images)"
    )
    _add(
        g,
        "--video-rule",
        dest="video_style",
        choices=style_names(),  # the registry's (mmpack.packing.video_rules)
        help="whose frame sampling, frame size and video tokens: qwen-vl-utils (Qwen2-VL / Qwen2.5-VL, default) "
        "or qwen3_vl (transformers' Qwen3-VL processor: timestamps before each temporal patch; the default "
        "with a Qwen3-VL --model DIR) or llava_onevision2 (LLaVA-OneVision-2's processor: 8/16/max frames by "
        "duration, a timestamp and <|image_pad|> block per frame; the default with a OneVision-2 --model DIR) "
        "or gemma4 (Gemma 4's processor: num_frames frames, an MM:SS timestamp and <|video|> block per frame; "
        "the rule of a Gemma 4 --model DIR)",
    )
    qwen3 = "; qwen3_vl: on all sampled frames' pixels together (its size.{})"
    for name, kind, what in (
        ("fps", float, "frames sampled per second"),
        ("min_frames", int, "fewest frames sampled"),
        ("max_frames", int, "most frames sampled"),
        ("min_pixels", int, "smart_resize lower bound on a frame's h*w"),
        ("max_pixels", int, "smart_resize upper bound on a frame's h*w"),
        ("total_pixels", float, "pixels all sampled frames of a video share, two frames per step"),
    ):
        default = option_default(f"video_{name}")
        shown = f"{default:.0f}" if kind is float and default > 100 else f"{default}"
        note = {
            "min_pixels": qwen3.format("shortest_edge"),
            "max_pixels": qwen3.format("longest_edge"),
            "total_pixels": "; qwen-vl-utils only",
        }.get(name, "")
        _add(
            g,
            f"--video-{name.replace('_', '-')}",
            dest=f"video_{name}",
            type=kind,
            help=f"{what} (default {shown}{note})",
        )
    _add(
        g,
        "--video-check",
        choices=VIDEO_CHECKS,
        help="header: plan from container metadata, checked against the frames the decoder shows (default); "
        "decode: also decode every planned frame at pack time, as the loader will (slow; a video that fails is "
        "rejected as undecodable_video)",
    )
    _add(
        g,
        "--max-video-seconds",
        type=float,
        help="longer videos (duration from the container) are rejected as video_too_long "
        f"(default {option_default('max_video_seconds'):.0f})",
    )
    _add(
        g,
        "--codec-videos",
        action="store_true",
        help="LLaVA-OneVision-2: run cv-preinfer (package codec-video-prep, in a venv of its own) on each raw "
        "local video and pack its codec canvases (cached by video content and knobs; docs/video.md)",
    )
    _add(g, "--cv-preinfer", metavar="PATH", help="the cv-preinfer executable (default: the one on PATH)")
    _add(
        g,
        "--codec-cache",
        metavar="DIR",
        help="cache folder of the codec assets (default ~/.cache/mmpack/codec-assets; on Ray, one every node "
        "sees)",
    )
    _add(
        g,
        "--codec-target-canvases",
        type=int,
        help=f"cv-preinfer's canvas budget (default {option_default('codec_target_canvases')})",
    )
    _add(
        g,
        "--codec-grouping",
        choices=CODEC_GROUPINGS,
        help=f"cv-preinfer's grouping (default {option_default('codec_grouping')})",
    )
    g = p.add_argument_group("bin packing")
    _add(g, "-M", "--max-samples-per-bin", type=int, help="at most N samples per bin")
    _add(
        g,
        "--max-images-per-bin",
        type=int,
        help="at most N images per bin; samples with more are rejected",
    )
    _add(
        g,
        "--algorithm",
        help=f"mmpack.packing.binpack.pack_lengths algorithm (default {option_default('algorithm')})",
    )
    _add(
        g,
        "--seed",
        type=int,
        help=f"seed of the order of bins in the shards (default {option_default('seed')})",
    )
    g = p.add_argument_group("output")
    _add(g, "-o", "--output", required=True, help="output folder or fsspec URL (s3://bucket/prefix)")
    _add(
        g,
        "-f",
        "--format",
        choices=OUTPUT_FORMATS,
        help=f"shard format(s) (default {option_default('format')})",
    )
    _add(
        g,
        "--max-bins-per-shard",
        type=int,
        help=f"bins per shard at most (default {option_default('max_bins_per_shard')})",
    )
    _add(
        g,
        "--max-shard-bytes",
        type=_size,
        help=f"estimated size cap per shard, e.g. 512M, 2G (default {option_default('max_shard_bytes') >> 20}M)",
    )
    _add(
        g,
        "--shard-prefix",
        help=f"shard and bin key prefix: letters, digits, _ and - (default {option_default('shard_prefix')})",
    )
    _add(
        g,
        "--energon",
        action="store_true",
        help="also write .nv-meta so Megatron-Energon reads the WebDataset shards",
    )
    _add(g, "--s3-endpoint", help="endpoint URL for s3:// inputs and outputs (or AWS_ENDPOINT_URL)")
    g = p.add_argument_group("job")
    _add(
        g,
        "-w",
        "--workers",
        type=int,
        help="worker processes for scan, lengths, write (local engine; at most one per CPU the job may use; "
        "under --engine ray every chunk is a Ray task of one CPU, as many at once as the cluster has CPUs)",
    )
    _add(
        g,
        "--engine",
        choices=ENGINES,
        help="where scan, lengths and write run: local (forked workers, -w) or ray (tasks on a Ray cluster; "
        "pip install -e .[ray]); the output is the same",
    )
    _add(
        g,
        "--ray-address",
        help="--engine ray: the cluster to join (default auto: the one running on this machine, else a new "
        "local one); the work folder (--work-dir) must be a URL or a filesystem every node sees (default for a URL "
        "output: <output>/_work)",
    )
    _add(
        g,
        "-S",
        "--stage",
        type=int,
        dest="start_stage",
        help=f"rerun from stage N ({', '.join(f'{i + 1}={s}' for i, s in enumerate(STAGES))}); "
        "default: resume, skipping completed stages",
    )
    _add(
        g,
        "--work-dir",
        help="folder or URL (s3://...) for stage outputs and markers (default <output>/_work; for a URL output, "
        "a local temp folder, or <output>/_work under --engine ray)",
    )
    _add(
        g,
        "--clean-work",
        action="store_true",
        help="delete the work folder's files after success (saves space; a rerun then redoes every stage); only "
        "files the job wrote there are deleted, and only in a folder that carries mmpack's marker",
    )
    _add(
        g,
        "--overwrite",
        action="store_true",
        help="write into an output (or work folder) that is not empty and was not made by mmpack: its files "
        "named like mmpack's (manifest.json, stats.json, rejects.jsonl, shards) are replaced, nothing else "
        "is touched or deleted (default: such a folder is refused)",
    )
    _add(
        g,
        "--chunk-size",
        type=int,
        help=f"samples per unit of parallel work (default {option_default('chunk_size')})",
    )
    _add(g, "--strict", action="store_true", help="fail on the first bad sample instead of rejecting it")
    _add(
        g,
        "--preview",
        type=int,
        metavar="N",
        help="pack nothing: show the first N records of the input (one .json/.jsonl file) as this job would pack "
        "them, in the page OUTPUT.preview/index.html (as `mmpack view RAW -n N`)",
    )
    _add(g, "--no-progress", dest="progress", action="store_false", help="no progress bars")
    _add(g, "--debug", action="store_true", help="show the traceback of an error")


def config_from_args(args: argparse.Namespace, only_stage: int | None = None) -> PackJobConfig:
    """The job config of parsed `mmpack pack` flags; ValueError for values the config refuses."""
    options = dict(vars(args))
    options.pop("command", None)  # the subcommand's name (mmpack's own parser)
    if options.pop("preview", None) is not None:  # the `mmpack` command shows it (mmpack.view.raw)
        raise ValueError("--preview is shown by the `mmpack pack` command: run `mmpack pack ... --preview N`")
    endpoint = options.pop("s3_endpoint", None)
    # Absolute paths: the same folder named from another working directory is the same job (fingerprints).
    model = options.pop("model", None)
    model = os.path.abspath(model) if model else None
    named = options.pop("tokenizer", None)
    named = named if named in (None, BYTE_TOKENIZER) else os.path.abspath(named)
    flags = {name: options.pop(name) for name in RULE_FLAG_FIELDS if name in options}
    tokenizer, options["image_rule"] = resolve_image_rule(model, named, flags)
    video_flags = {name: options.pop(name) for name in VIDEO_FLAG_FIELDS if name in options}
    options["video_rule"] = resolve_video_rule(model, named, video_flags, options["image_rule"])
    options |= resolve_chat_template(model, named, options.pop("chat_template_file", None))
    options["inputs"] = tuple(options["inputs"])
    options["storage_options"] = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else {}
    # no tokenizer: refused by the config with a one-line message
    return job_config(**options, tokenizer=tokenizer or "", only_stage=only_stage)


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
