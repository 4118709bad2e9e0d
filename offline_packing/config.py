"""Configuration and result of an offline packing job (`mmpack pack`).

`PackJobConfig` mirrors the flags. Each stage reads only its own frozen config (`ScanConfig`,
`LengthsConfig`, `BinpackConfig`, `WriteConfig`), cut from the job's by field name; a stage's fingerprint
hashes that whole config (see `mmpack.offline_packing.fingerprint`), so an option cannot be read by a stage without
being part of its fingerprint. Every job field belongs to a stage config, to `INPUT_FIELDS` or to
`RUN_CONTROL_FIELDS` (options that cannot change any output byte); a test holds them together.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Literal, overload

from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS
from mmpack.packing.image_tokens import CLIP_MEAN, CLIP_STD
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from mmpack.packing.video_tokens import VideoTokenRule

if TYPE_CHECKING:
    from mmpack.packing.chat import ChatTemplate

_VIDEO_DEFAULTS = VideoTokenRule()

STAGES = ("scan", "lengths", "binpack", "write")
OVERLENGTH_POLICIES = ("drop", "truncate", "error")
OUTPUT_FORMATS = ("arrow", "wds", "both")
IMAGE_CHECKS = ("header", "decode")
VIDEO_CHECKS = ("header", "decode")
VERIFY_INPUTS = ("stat", "sha256")
# The inputs enter the scan fingerprint by identity (canonical path, size, mtime_ns or sha256), not as typed.
INPUT_FIELDS = frozenset({"inputs"})
# Job options that change no output byte: how the job runs, not what it makes.
RUN_CONTROL_FIELDS = frozenset(
    {
        "workers",
        "engine",
        "ray_address",
        "work_dir",
        "clean_work",
        "overwrite",
        "start_stage",
        "only_stage",
        "progress",
        "storage_options",
        "debug",
    }
)
ENGINES = ("local", "ray")
# Records whose JSON text is longer are `record_too_large` rejects, found before they are parsed or tokenized:
# real conversations are kilobytes, and a tokenizer fed hundreds of megabytes aborts the process.
DEFAULT_MAX_RECORD_BYTES = 8 << 20


@dataclass(kw_only=True, frozen=True)
class PackJobConfig:
    """Every option of a packing job; mirrors the `mmpack pack` flags one to one.

    Same config + same inputs => byte-identical shards, manifest, rejects and stats.
    """

    inputs: tuple[str, ...]  # .json / .jsonl / .parquet files, folders or globs
    output: str  # local folder or fsspec URL (s3://bucket/prefix)
    seq_len: int  # bin capacity in tokens (-L)
    tokenizer: str  # tokenizer.json or a folder holding one; BYTE_TOKENIZER names the byte-level demo one
    image_root: str | None = None  # image paths are relative to it (default: each input file's folder)
    max_samples_per_bin: int | None = None  # -M
    max_images_per_bin: int | None = None
    algorithm: str = "auto"
    seed: int = 0
    format: str = "arrow"  # "arrow" | "wds" | "both"
    max_bins_per_shard: int = 1024
    max_shard_bytes: int = 256 * 2**20
    workers: int = 1
    engine: str = "local"  # "local": forked workers on this machine; "ray": tasks on a Ray cluster
    ray_address: str = "auto"  # --engine ray: "auto" (a cluster on this machine, else a new one) or host:port
    overlength: str = "drop"
    strict: bool = False
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    # The rest of the image rule: pixel values (set from --model DIR's preprocessor_config.json)
    temporal_patch_size: int = 2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    rescale_factor: float = 1 / 255
    resample: int = 3  # PIL filter, 3 = bicubic
    # The video rule (qwen-vl-utils): frames sampled per second, frame count bounds, per-frame pixel bounds and
    # the pixel budget shared by a video's frames; patch, merge and temporal patch sizes are the image rule's
    video_fps: float = _VIDEO_DEFAULTS.fps
    video_min_frames: int = _VIDEO_DEFAULTS.min_frames
    video_max_frames: int = _VIDEO_DEFAULTS.max_frames
    video_min_pixels: int = _VIDEO_DEFAULTS.min_pixels
    video_max_pixels: int = _VIDEO_DEFAULTS.max_pixels
    video_total_pixels: float = _VIDEO_DEFAULTS.total_pixels
    video_rule_style: str = (
        _VIDEO_DEFAULTS.style
    )  # whose video rule: qwen-vl-utils or qwen3_vl (the processor's)
    max_video_seconds: float = 3 * 3600.0  # longer videos (from the container) are rejects
    default_system: str | None = None  # system prompt for records without one (overrides the template's)
    no_default_system: bool = False  # leave out the chat template's own default system turn
    chat_template: str | None = None  # Jinja source of the model folder's chat template; None = built-in Qwen
    chat_template_origin: str = ""  # the file it came from (manifest, messages)
    chat_template_vars: tuple[tuple[str, str], ...] = ()  # special tokens the template sees (bos_token, ...)
    image_check: str = "header"  # "header": sizes + end-marker check; "decode": full decode of every image
    video_check: str = "header"  # "header": container metadata; "decode": also decode every planned frame
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # larger images (from the header) are rejects
    verify_inputs: str = "stat"  # input identity: "stat" (path, size, mtime_ns) or "sha256" (content)
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES  # longer records (their JSON text) are rejects
    energon: bool = False  # also write .nv-meta for Megatron-Energon (needs a wds output)
    shard_prefix: str = "packed"
    work_dir: str | None = None  # folder or URL for stage outputs and markers (default: `resolve_work_dir`)
    clean_work: bool = False  # delete the work folder after a successful job (a rerun then starts over)
    overwrite: bool = False  # adopt a non-empty output / work folder without mmpack's marker (--overwrite)
    chunk_size: int = 2048  # samples per scan/lengths chunk (the unit of parallel work)
    start_stage: int | None = None  # -S: rerun from this stage (earlier ones must be complete); None = resume
    only_stage: int | None = None  # run only this stage (python -m offline_packing.<stage>)
    progress: bool = True
    debug: bool = False  # tracebacks instead of one-line errors (CLI)
    storage_options: dict = field(default_factory=dict, hash=False)  # fsspec options for inputs and output

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not self.inputs:
            bad("at least one input (-i) is required")
        if self.seq_len < 1:
            bad(f"seq_len (-L) must be >= 1, got {self.seq_len}")
        if not self.tokenizer:
            bad(
                f"no tokenizer: pass -t TOKENIZER or --model DIR (-t {BYTE_TOKENIZER} for the byte-level demo one)"
            )
        if self.default_system is not None and self.no_default_system:
            bad("--default-system and --no-default-system exclude each other; keep one")
        if self.format not in OUTPUT_FORMATS:
            bad(f"format must be one of {OUTPUT_FORMATS}, got {self.format!r}")
        if self.overlength not in OVERLENGTH_POLICIES:
            bad(f"overlength must be one of {OVERLENGTH_POLICIES}, got {self.overlength!r}")
        if self.image_check not in IMAGE_CHECKS:
            bad(f"image_check must be one of {IMAGE_CHECKS}, got {self.image_check!r}")
        if self.video_check not in VIDEO_CHECKS:
            bad(f"video_check must be one of {VIDEO_CHECKS}, got {self.video_check!r}")
        if self.verify_inputs not in VERIFY_INPUTS:
            bad(f"verify_inputs must be one of {VERIFY_INPUTS}, got {self.verify_inputs!r}")
        if self.max_record_bytes < 1:
            bad(f"--max-record-bytes must be >= 1, got {self.max_record_bytes}")
        if self.max_image_pixels < 1:
            bad(f"--max-image-pixels must be >= 1, got {self.max_image_pixels}")
        if not self.max_video_seconds > 0:
            bad(f"--max-video-seconds must be > 0, got {self.max_video_seconds}")
        video_rule(self)  # raises ValueError naming the --video-* flag
        if self.engine not in ENGINES:
            bad(f"engine must be one of {ENGINES}, got {self.engine!r}")
        if self.workers < 1:
            bad(f"workers (-w) must be >= 1, got {self.workers}")
        if self.max_bins_per_shard < 1 or self.max_shard_bytes < 1 or self.chunk_size < 1:
            bad("max_bins_per_shard, max_shard_bytes and chunk_size must be >= 1")
        for name in ("max_samples_per_bin", "max_images_per_bin"):
            value = getattr(self, name)
            if value is not None and value < 1:
                bad(f"{name} must be >= 1 or unset, got {value}")
        if self.start_stage is not None and not 1 <= self.start_stage <= len(STAGES):
            bad(f"start stage (-S) must be in 1..{len(STAGES)}, got {self.start_stage}")
        if self.only_stage is not None and not 1 <= self.only_stage <= len(STAGES):
            bad(f"only_stage must be in 1..{len(STAGES)}, got {self.only_stage}")
        if self.energon and self.format == "arrow":
            bad("--energon needs WebDataset shards: use --format wds or both")
        from mmpack.packing.format import bin_key

        bin_key(self.shard_prefix, 0)  # raises ValueError on a bad prefix

    @property
    def formats(self) -> tuple[str, ...]:
        """Shard formats to write, in manifest order."""
        return ("arrow", "wds") if self.format == "both" else (self.format,)

    @overload
    def stage_config(self, stage: Literal["scan"]) -> ScanConfig: ...
    @overload
    def stage_config(self, stage: Literal["lengths"]) -> LengthsConfig: ...
    @overload
    def stage_config(self, stage: Literal["binpack"]) -> BinpackConfig: ...
    @overload
    def stage_config(self, stage: Literal["write"]) -> WriteConfig: ...
    @overload
    def stage_config(self, stage: str) -> StageConfig: ...

    def stage_config(self, stage: str) -> StageConfig:
        """The frozen config of `stage` ("scan", "lengths", "binpack" or "write")."""
        cls = STAGE_CONFIGS[stage]
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


@dataclass(kw_only=True, frozen=True)
class ScanConfig:
    """What stage 1 (scan) reads besides the input files: how records and image headers are checked."""

    image_root: str | None
    image_check: str
    max_record_bytes: int
    max_image_pixels: int  # also the limit on a video's frame size
    max_video_seconds: float
    chunk_size: int
    strict: bool
    verify_inputs: str


@dataclass(kw_only=True, frozen=True)
class LengthsConfig:
    """What stage 2 (lengths) reads: the length model (tokenizer, chat template, image-token rule) and the
    over-length policy."""

    tokenizer: str
    seq_len: int
    overlength: str
    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    resample: int
    video_fps: float
    video_min_frames: int
    video_max_frames: int
    video_min_pixels: int
    video_max_pixels: int
    video_total_pixels: float
    video_check: str
    video_rule_style: str
    default_system: str | None
    no_default_system: bool
    chat_template: str | None
    chat_template_origin: str
    chat_template_vars: tuple[tuple[str, str], ...]
    max_images_per_bin: int | None
    strict: bool
    verify_inputs: str


@dataclass(kw_only=True, frozen=True)
class BinpackConfig:
    """What stage 3 (binpack) reads: the packing problem, the bin order and the cut into shards."""

    seq_len: int
    max_samples_per_bin: int | None
    max_images_per_bin: int | None
    algorithm: str
    seed: int
    max_bins_per_shard: int
    max_shard_bytes: int


@dataclass(kw_only=True, frozen=True)
class WriteConfig:
    """What stage 4 (write) adds: where and how the shards and metadata are written."""

    output: str
    format: str
    shard_prefix: str
    energon: bool

    @property
    def formats(self) -> tuple[str, ...]:
        return ("arrow", "wds") if self.format == "both" else (self.format,)


def chat_template(cfg: PackJobConfig | LengthsConfig) -> ChatTemplate:
    """The chat template of a job (or lengths) config."""
    from mmpack.packing.chat import ChatTemplate

    return ChatTemplate(
        default_system=cfg.default_system,
        source=cfg.chat_template,
        variables=cfg.chat_template_vars,
        no_default_system=cfg.no_default_system,
        origin=cfg.chat_template_origin or "chat template",
    )


def video_rule(cfg: PackJobConfig | LengthsConfig) -> VideoTokenRule:
    """The video rule of a job (or lengths) config: the --video-* flags (or --model DIR's video processor) and
    the image rule's patch sizes."""
    return VideoTokenRule(
        fps=cfg.video_fps,
        min_frames=cfg.video_min_frames,
        max_frames=cfg.video_max_frames,
        min_pixels=cfg.video_min_pixels,
        max_pixels=cfg.video_max_pixels,
        total_pixels=cfg.video_total_pixels,
        patch_size=cfg.patch_size,
        merge_size=cfg.merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        style=cfg.video_rule_style,
    )


StageConfig = ScanConfig | LengthsConfig | BinpackConfig | WriteConfig
STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "scan": ScanConfig,
    "lengths": LengthsConfig,
    "binpack": BinpackConfig,
    "write": WriteConfig,
}


@dataclass
class PackSummary:
    """What a packing job did; `format_table()` is the end-of-job summary."""

    output: str
    samples_read: int = 0
    samples_packed: int = 0
    samples_rejected: int = 0
    samples_truncated: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    bins: int = 0
    tokens: int = 0
    image_tokens: int = 0
    video_tokens: int = 0
    fill_efficiency: float = 0.0
    output_bytes: int = 0
    shards: list[dict] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    stages_skipped: list[str] = field(default_factory=list)

    def format_table(self) -> str:
        """A short human-readable summary."""
        rows = [
            ("output", self.output),
            ("samples read", f"{self.samples_read}"),
            ("samples packed", f"{self.samples_packed}"),
            ("samples rejected", f"{self.samples_rejected}"),
        ]
        rows += [(f"  {reason}", f"{n}") for reason, n in sorted(self.rejected_by_reason.items())]
        rows.append(("samples truncated", f"{self.samples_truncated}"))
        rows += [
            ("bins", f"{self.bins}"),
            ("tokens", f"{self.tokens} ({self.image_tokens} image, {self.video_tokens} video)"),
            ("fill efficiency", f"{100 * self.fill_efficiency:.2f}%"),
            ("shards", f"{len(self.shards)} ({self.output_bytes / 2**20:.1f} MiB)"),
        ]
        for stage in STAGES:
            if stage in self.stage_seconds:
                rows.append((f"time {stage}", f"{self.stage_seconds[stage]:.2f} s"))
            elif stage in self.stages_skipped:
                rows.append((f"time {stage}", "skipped (already complete)"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
