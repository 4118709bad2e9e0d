"""Configuration of an offline packing job (`mmpack pack`): one frozen config per stage, nested in the job's.

`PackJobConfig` holds what the job packs (inputs, output, tokenizer, `seq_len`, and the few options more than
one stage reads) and one section per stage: `scan` (`ScanConfig`), `lengths` (`LengthsConfig`: the image
rule, the video rule and the chat template as the objects `mmpack.packing` defines), `binpack`
(`BinpackConfig`), `write` (`WriteConfig`), and `control` (`ControlConfig`: how the job runs, which changes
no output byte). Every default is a field default here; the flags (`mmpack.offline_packing.flags`) are named
like the fields and take their defaults from them (`mmpack.offline_packing.options`).

A stage reads only its view of the job (`stage_config`: its section and the job fields it names, cut by
field name), and its fingerprint hashes that whole view (`mmpack.offline_packing.fingerprint`), so an option
cannot be read by a stage without being part of its fingerprint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Literal, overload

from mmpack.packing.chat_template import ChatTemplate
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS, bin_key
from mmpack.packing.image_tokens import ImageTokenRule
from mmpack.packing.tokenizer import BYTE_TOKENIZER, ControlTokens, control_tokens_of
from mmpack.packing.video_tokens import VideoTokenRule

STAGES = ("scan", "lengths", "binpack", "write")
OVERLENGTH_POLICIES = ("drop", "truncate", "error")
OUTPUT_FORMATS = ("arrow", "wds", "both")
IMAGE_CHECKS = ("header", "decode")
CODEC_GROUPINGS = ("readiness", "fixed")  # cv-preinfer's --grouping_mode
VIDEO_CHECKS = ("header", "decode")
VERIFY_INPUTS = ("stat", "sha256")
ENGINES = ("local", "ray")
# Records whose JSON text is longer are `record_too_large` rejects, found before they are parsed or tokenized:
# real conversations are kilobytes, and a tokenizer fed hundreds of megabytes aborts the process.
DEFAULT_MAX_RECORD_BYTES = 8 << 20
# The video rule's patch, merge and temporal patch sizes are the image rule's (one vision tower).
SHARED_PATCH_FIELDS = ("patch_size", "merge_size", "temporal_patch_size")


def _one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def require_utf8_path(path: str, what: str) -> None:
    """Raises ValueError naming `path` as bytes when its name is not valid UTF-8 (Python keeps such bytes as lone
    surrogates, which no manifest, reject row, marker or URL can hold)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} path {os.fsencode(path)!r} is not valid UTF-8 (a file or folder name in another encoding); "
            "rename it to UTF-8, e.g. convmv -f latin1 -t utf8 --notest"
        ) from None


def _at_least(minimum: int, **values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {minimum}, got {value}")


@dataclass(kw_only=True, frozen=True)
class ScanConfig:
    """Stage 1 (scan): how records are read and how their images and videos are checked."""

    image_root: str | None = None  # image paths are relative to it (default: each input file's folder)
    image_check: str = "header"  # "header": sizes + end-marker check; "decode": full decode of every image
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # longer records (their JSON text) are rejects
    max_image_pixels: int = (
        DEFAULT_MAX_IMAGE_PIXELS  # larger images (from the header) are rejects; also frames
    )
    max_video_seconds: float = 3 * 3600.0  # longer videos (from the container) are rejects
    chunk_size: int = 2048  # samples per scan/lengths chunk (the unit of parallel work)
    # LLaVA-OneVision-2 codec video made at pack time (`inputs/codec_preinfer.py`): raw videos through cv-preinfer
    codec_videos: bool = False  # make each raw video's codec assets and pack it as a codec video
    cv_preinfer: str | None = None  # the cv-preinfer executable (default: the one on PATH)
    codec_cache: str | None = None  # the cache of codec assets (default: ~/.cache/mmpack/codec-assets)
    codec_target_canvases: int = 32  # the preprocessor's canvas budget (groups = this / 4)
    codec_grouping: str = "readiness"  # "readiness" (groups by content) or "fixed" (32 frames a group)

    def __post_init__(self) -> None:
        _one_of("image_check", self.image_check, IMAGE_CHECKS)
        _one_of("codec_grouping", self.codec_grouping, CODEC_GROUPINGS)
        if self.codec_target_canvases < 4 or self.codec_target_canvases % 4:
            raise ValueError(
                f"--codec-target-canvases must be a positive multiple of 4 (canvases per group), got "
                f"{self.codec_target_canvases}"
            )
        _at_least(1, max_record_bytes=self.max_record_bytes, max_image_pixels=self.max_image_pixels)
        _at_least(1, chunk_size=self.chunk_size)
        if not self.max_video_seconds > 0:
            raise ValueError(f"--max-video-seconds must be > 0, got {self.max_video_seconds}")


@dataclass(kw_only=True, frozen=True)
class LengthsConfig:
    """Stage 2 (lengths): the length model (image rule, video rule, chat template) and the over-length
    policy."""

    image_rule: ImageTokenRule = field(default_factory=ImageTokenRule)
    video_rule: VideoTokenRule = field(default_factory=VideoTokenRule)  # patch sizes: the image rule's
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)  # source None: the built-in Qwen one
    overlength: str = "drop"  # samples longer than seq_len: "drop" (reject), "truncate" or "error"
    video_check: str = "header"  # "header": container metadata; "decode": also decode every planned frame

    def __post_init__(self) -> None:
        _one_of("overlength", self.overlength, OVERLENGTH_POLICIES)
        _one_of("video_check", self.video_check, VIDEO_CHECKS)
        for name in SHARED_PATCH_FIELDS:
            image, video = getattr(self.image_rule, name), getattr(self.video_rule, name)
            if image != video:
                raise ValueError(
                    f"the video rule's {name} ({video}) differs from the image rule's ({image}): both are the "
                    "vision tower's; build the video rule with the image rule's patch sizes"
                )
        control_tokens_of(self.image_rule, self.video_rule)  # rules of two models' tokens are refused here

    @property
    def control_tokens(self) -> ControlTokens:
        """The control tokens the job's tokenizer must have (and a record's text may not hold) under its
        image and video rules."""
        return control_tokens_of(self.image_rule, self.video_rule)


@dataclass(kw_only=True, frozen=True)
class BinpackConfig:
    """Stage 3 (binpack): the packing problem's caps, the algorithm, the bin order and the cut into shards."""

    max_samples_per_bin: int | None = None  # -M
    algorithm: str = "auto"  # an `mmpack.packing.binpack.pack_lengths` algorithm
    seed: int = 0  # seed of the order of bins in the shards
    max_bins_per_shard: int = 1024
    max_shard_bytes: int = 256 * 2**20  # estimated size cap per shard

    def __post_init__(self) -> None:
        _at_least(1, max_samples_per_bin=self.max_samples_per_bin, max_bins_per_shard=self.max_bins_per_shard)
        _at_least(1, max_shard_bytes=self.max_shard_bytes)


@dataclass(kw_only=True, frozen=True)
class WriteConfig:
    """Stage 4 (write): the shard formats and names, and the Energon metadata."""

    format: str = "arrow"  # "arrow" | "wds" | "both"
    shard_prefix: str = "packed"  # shard and bin key prefix: letters, digits, _ and -
    energon: bool = False  # also write .nv-meta for Megatron-Energon (needs a wds output)

    def __post_init__(self) -> None:
        _one_of("format", self.format, OUTPUT_FORMATS)
        if self.energon and self.format == "arrow":
            raise ValueError("--energon needs WebDataset shards: use --format wds or both")
        bin_key(self.shard_prefix, 0)  # raises ValueError on a bad prefix

    @property
    def formats(self) -> tuple[str, ...]:
        """Shard formats to write, in manifest order."""
        return ("arrow", "wds") if self.format == "both" else (self.format,)


@dataclass(kw_only=True, frozen=True)
class ControlConfig:
    """How the job runs, not what it makes: none of these changes an output byte (no fingerprint has them)."""

    workers: int = 1  # local engine: forked worker processes
    engine: str = "local"  # "local": forked workers on this machine; "ray": tasks on a Ray cluster
    ray_address: str = "auto"  # --engine ray: "auto" (a cluster on this machine, else a new one) or host:port
    work_dir: str | None = None  # folder or URL for stage outputs and markers (default: `resolve_work_dir`)
    clean_work: bool = False  # delete the work folder after a successful job (a rerun then starts over)
    overwrite: bool = False  # adopt a non-empty output / work folder without mmpack's marker (--overwrite)
    start_stage: int | None = None  # -S: rerun from this stage (earlier ones must be complete); None = resume
    only_stage: int | None = None  # run only this stage (python -m offline_packing.<stage>)
    progress: bool = True
    debug: bool = False  # tracebacks instead of one-line errors (CLI)
    storage_options: dict = field(default_factory=dict, hash=False)  # fsspec options for inputs and output

    def __post_init__(self) -> None:
        _one_of("engine", self.engine, ENGINES)
        _at_least(1, workers=self.workers)
        for name, value in (("start stage (-S)", self.start_stage), ("only_stage", self.only_stage)):
            if value is not None and not 1 <= value <= len(STAGES):
                raise ValueError(f"{name} must be in 1..{len(STAGES)}, got {value}")


@dataclass(kw_only=True, frozen=True)
class PackJobConfig:
    """Every option of a packing job. Same config + same inputs => byte-identical shards, manifest, rejects
    and stats. `mmpack.offline_packing.options.job_config` builds one from flat option names (the flags')."""

    inputs: tuple[str, ...]  # .json / .jsonl / .parquet / .tar files, folders or globs (local or URLs)
    output: str  # local folder or fsspec URL (s3://bucket/prefix)
    seq_len: int  # bin capacity in tokens (-L); also the over-length limit
    tokenizer: str  # tokenizer.json or a folder holding one; BYTE_TOKENIZER names the byte-level demo one
    max_images_per_bin: int | None = None  # samples with more are rejects; bins hold at most this many
    strict: bool = False  # fail on the first bad sample instead of rejecting it
    verify_inputs: str = "stat"  # input identity: "stat" (path, size, mtime_ns) or "sha256" (content)
    scan: ScanConfig = field(default_factory=ScanConfig)
    lengths: LengthsConfig = field(default_factory=LengthsConfig)
    binpack: BinpackConfig = field(default_factory=BinpackConfig)
    write: WriteConfig = field(default_factory=WriteConfig)
    control: ControlConfig = field(default_factory=ControlConfig)

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("at least one input (-i) is required")
        if self.seq_len < 1:
            raise ValueError(f"seq_len (-L) must be >= 1, got {self.seq_len}")
        if not self.tokenizer:
            raise ValueError(
                f"no tokenizer: pass -t TOKENIZER or --model DIR (-t {BYTE_TOKENIZER} for the byte-level demo one)"
            )
        _at_least(1, max_images_per_bin=self.max_images_per_bin)
        _one_of("verify_inputs", self.verify_inputs, VERIFY_INPUTS)
        named = {"-o": self.output, "--work-dir": self.control.work_dir, "--image-root": self.scan.image_root}
        for what, path in [*(("-i", p) for p in self.inputs), *named.items(), ("-t", self.tokenizer)]:
            if path is not None:
                require_utf8_path(path, what)

    @overload
    def stage_config(self, stage: Literal["scan"]) -> ScanStage: ...
    @overload
    def stage_config(self, stage: Literal["lengths"]) -> LengthsStage: ...
    @overload
    def stage_config(self, stage: Literal["binpack"]) -> BinpackStage: ...
    @overload
    def stage_config(self, stage: Literal["write"]) -> WriteStage: ...
    @overload
    def stage_config(self, stage: str) -> StageConfig: ...

    def stage_config(self, stage: str) -> StageConfig:
        """What `stage` ("scan", "lengths", "binpack" or "write") reads: its section and the job fields it
        names, cut from the job by field name."""
        cls = STAGE_CONFIGS[stage]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


@dataclass(kw_only=True, frozen=True)
class ScanStage:
    """What stage 1 reads besides the input files."""

    scan: ScanConfig
    strict: bool
    verify_inputs: str


@dataclass(kw_only=True, frozen=True)
class LengthsStage:
    """What stage 2 reads: the length model, the tokenizer and the limits a sample must keep."""

    lengths: LengthsConfig
    tokenizer: str
    seq_len: int
    max_images_per_bin: int | None
    strict: bool
    verify_inputs: str


@dataclass(kw_only=True, frozen=True)
class BinpackStage:
    """What stage 3 reads: the packing problem, the bin order and the cut into shards."""

    binpack: BinpackConfig
    seq_len: int
    max_images_per_bin: int | None


@dataclass(kw_only=True, frozen=True)
class WriteStage:
    """What stage 4 adds: where and how the shards and metadata are written."""

    write: WriteConfig
    output: str


StageConfig = ScanStage | LengthsStage | BinpackStage | WriteStage
STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "scan": ScanStage,
    "lengths": LengthsStage,
    "binpack": BinpackStage,
    "write": WriteStage,
}
# The job fields no stage reads: the inputs enter the scan fingerprint by identity (canonical path, size,
# mtime_ns or sha256), not as typed; the control section changes no output byte.
INPUT_FIELDS = frozenset({"inputs"})
RUN_CONTROL_FIELDS = frozenset({"control"})
