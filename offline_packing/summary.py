"""What a packing job did (`run_pack`'s result): counts from the manifest, time per stage, and where the
engine ran its tasks."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmpack.offline_packing.config import STAGES


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
    tasks_per_node: dict[str, dict[str, int]] = field(
        default_factory=dict
    )  # --engine ray: stage -> node -> tasks

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
