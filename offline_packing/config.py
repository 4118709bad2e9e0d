"""Configuration and result of an offline packing job (`mmpack pack`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

STAGES = ("scan", "lengths", "binpack", "write")
OVERLENGTH_POLICIES = ("drop", "truncate", "error")
OUTPUT_FORMATS = ("arrow", "wds", "both")
IMAGE_CHECKS = ("header", "decode")


@dataclass(kw_only=True, frozen=True)
class PackJobConfig:
    """Every option of a packing job; mirrors the `mmpack pack` flags one to one.

    Same config + same inputs => byte-identical shards, manifest, rejects and stats.
    """

    inputs: tuple[str, ...]  # .json / .jsonl / .parquet files, folders or globs
    output: str  # local folder or fsspec URL (s3://bucket/prefix)
    seq_len: int  # bin capacity in tokens (-L)
    image_root: str | None = None  # image paths are relative to it (default: each input file's folder)
    tokenizer: str | None = None  # tokenizer.json or a folder holding one; None = byte fallback (demo)
    max_samples_per_bin: int | None = None  # -M
    max_images_per_bin: int | None = None
    algorithm: str = "auto"
    seed: int = 0
    format: str = "arrow"  # "arrow" | "wds" | "both"
    max_bins_per_shard: int = 1024
    max_shard_bytes: int = 256 * 2**20
    workers: int = 1
    overlength: str = "drop"
    strict: bool = False
    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 3136
    max_pixels: int = 12845056
    default_system: str | None = None  # system prompt added where a record has none
    image_check: str = "header"  # "header": sizes + end-marker check; "decode": full decode of every image
    energon: bool = False  # also write .nv-meta for Megatron-Energon (needs a wds output)
    shard_prefix: str = "packed"
    work_dir: str | None = None  # local folder for stage outputs and markers (default <output>/_work)
    clean_work: bool = False  # delete the work folder after a successful job (a rerun then starts over)
    chunk_size: int = 2048  # samples per scan/lengths chunk (the unit of parallel work)
    start_stage: int | None = None  # -S: rerun from this stage (earlier ones must be complete); None = resume
    only_stage: int | None = None  # run only this stage (python -m offline_packing.<stage>)
    progress: bool = True
    storage_options: dict = field(default_factory=dict, hash=False)  # fsspec options for the output

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(msg)

        if not self.inputs:
            bad("at least one input (-i) is required")
        if self.seq_len < 1:
            bad(f"seq_len (-L) must be >= 1, got {self.seq_len}")
        if self.format not in OUTPUT_FORMATS:
            bad(f"format must be one of {OUTPUT_FORMATS}, got {self.format!r}")
        if self.overlength not in OVERLENGTH_POLICIES:
            bad(f"overlength must be one of {OVERLENGTH_POLICIES}, got {self.overlength!r}")
        if self.image_check not in IMAGE_CHECKS:
            bad(f"image_check must be one of {IMAGE_CHECKS}, got {self.image_check!r}")
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
        from packing.format import bin_key

        bin_key(self.shard_prefix, 0)  # raises ValueError on a bad prefix

    @property
    def formats(self) -> tuple[str, ...]:
        """Shard formats to write, in manifest order."""
        return ("arrow", "wds") if self.format == "both" else (self.format,)

    def stage_fingerprint(self, stage: int) -> str:
        """Hash of every option that stage `stage` (and the stages before it) depends on."""
        keys: dict[int, tuple[str, ...]] = {
            1: ("inputs", "image_root", "image_check", "chunk_size", "strict"),
            2: (
                "tokenizer",
                "seq_len",
                "overlength",
                "patch_size",
                "merge_size",
                "min_pixels",
                "max_pixels",
                "default_system",
                "max_images_per_bin",
            ),
            3: ("max_samples_per_bin", "algorithm", "seed"),
            4: ("format", "max_bins_per_shard", "max_shard_bytes", "energon", "shard_prefix", "output"),
        }
        wanted = [k for s, names in keys.items() if s <= stage for k in names]
        values = {k: v for k, v in asdict(self).items() if k in wanted}
        return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class PackSummary:
    """What a packing job did; `format_table()` is the end-of-job summary."""

    output: str
    samples_read: int = 0
    samples_packed: int = 0
    samples_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    bins: int = 0
    tokens: int = 0
    image_tokens: int = 0
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
        rows += [
            ("bins", f"{self.bins}"),
            ("tokens", f"{self.tokens} ({self.image_tokens} image)"),
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
