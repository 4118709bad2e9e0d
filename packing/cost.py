"""Compute cost of a packed bin: a linear model over four per-bin features.

    cost = a * tokens + b * sum(sample_len^2) + c * image_patches + d * sum(image_patches^2)

`tokens` is the bin's token count (text and image-pad tokens), `sum(sample_len^2)` drives the attention
score work of block-diagonal causal attention, `image_patches` the vision tower's per-patch work (patches
before the merge, t*h*w per image) and `sum(image_patches^2)` its full attention within each image.

Default coefficients (`CostModel.dense`) count training FLOPs (forward + backward = 3x forward) in units of
one text token's dense-layer work, 72 * h^2 * L for a language model of hidden size h and L layers:
a = 1; b = 6 * h * L / (72 * h^2 * L) = 1 / (12 h) (causal attention scores and values, 2 * s^2 * h
forward per layer); for a ViT of hidden size hv and Lv layers with full attention per image,
c = hv^2 * Lv / (h^2 * L) and d = 12 * hv * Lv / (72 * h^2 * L). A ViT that attends within windows of W
patches in all but Lf layers (Qwen2.5-VL) moves the windowed layers' attention into c (12 * hv * W per patch
and layer) and keeps Lf in d. `DEFAULT_COST_MODEL` is Qwen2.5-VL-7B's shape (h 3584, L 28, hv 1280, Lv 32)
counted with full attention in every ViT layer, an upper bound on the image attention (the real tower
attends over whole images in 4 of the 32 layers); the trainer builds the model of the run it trains
(`mmpack.trainer.training.balance_cost_model`). Measured step times give better coefficients: `CostModel.fit`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

COST_FEATURES: tuple[str, ...] = ("tokens", "sum_sq_seq_len", "image_patches", "sum_sq_image_patches")


def bin_cost_features(seq_lens: np.ndarray, image_grid_thw: np.ndarray) -> np.ndarray:
    """The four cost features (float64 [4], in `COST_FEATURES` order) of one bin."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    grid = np.asarray(image_grid_thw, dtype=np.float64).reshape(-1, 3)
    patches = grid.prod(axis=1)
    return np.array([lens.sum(), (lens * lens).sum(), patches.sum(), (patches * patches).sum()])


def features_from_offsets(
    seq_lens: np.ndarray, seq_offsets: np.ndarray, image_grid_thw: np.ndarray, image_offsets: np.ndarray
) -> np.ndarray:
    """Cost features (float64 [n, 4]) of n bins stored flat: bin i holds seq_lens[seq_offsets[i]:
    seq_offsets[i+1]] and images image_grid_thw[image_offsets[i]:image_offsets[i+1]] (rows of 3)."""
    lens = np.asarray(seq_lens, dtype=np.float64)
    patches = np.asarray(image_grid_thw, dtype=np.float64).reshape(-1, 3).prod(axis=1)
    out = np.zeros((len(seq_offsets) - 1, 4))
    out[:, 0] = _segment_sums(lens, seq_offsets)
    out[:, 1] = _segment_sums(lens * lens, seq_offsets)
    out[:, 2] = _segment_sums(patches, image_offsets)
    out[:, 3] = _segment_sums(patches * patches, image_offsets)
    return out


def add_video_features(
    features: np.ndarray, video_grid_thw: np.ndarray, video_offsets: np.ndarray
) -> np.ndarray:
    """`features` plus the vision cost of each bin's videos (rows of 3, bin i holds video_grid_thw[video_offsets[i]:
    video_offsets[i+1]]): a video's t temporal patches attend within themselves, so it counts as t images of
    h x w patches (t*h*w patches, t*(h*w)^2 attention)."""
    grids = np.asarray(video_grid_thw, dtype=np.float64).reshape(-1, 3)
    per_step = grids[:, 1] * grids[:, 2]
    out = np.array(features, dtype=np.float64, copy=True)
    out[:, 2] += _segment_sums(grids[:, 0] * per_step, video_offsets)
    out[:, 3] += _segment_sums(grids[:, 0] * per_step * per_step, video_offsets)
    return out


def _segment_sums(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    cumulative = np.concatenate(([0.0], np.cumsum(values)))
    offsets = np.asarray(offsets, dtype=np.int64)
    return cumulative[offsets[1:]] - cumulative[offsets[:-1]]


@dataclass(kw_only=True, frozen=True)
class CostModel:
    """Coefficients of the per-bin cost (see the module docstring); all must be finite and >= 0."""

    tokens: float = 1.0
    sum_sq_seq_len: float = 0.0
    image_patches: float = 0.0
    sum_sq_image_patches: float = 0.0

    def __post_init__(self) -> None:
        for name in COST_FEATURES:
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"cost coefficient {name} must be a finite number >= 0, got {value!r}")
        if not any(getattr(self, name) for name in COST_FEATURES):
            raise ValueError("at least one cost coefficient must be > 0")

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, name) for name in COST_FEATURES], dtype=np.float64)

    def cost(self, features: np.ndarray) -> np.ndarray:
        """Cost of each bin from its features ([n, 4] -> [n]; [4] -> scalar array)."""
        features = np.asarray(features, dtype=np.float64)
        if features.shape[-1] != len(COST_FEATURES):
            raise ValueError(f"features must have {len(COST_FEATURES)} columns, got shape {features.shape}")
        return features @ self.coefficients

    @classmethod
    def from_coefficients(cls, values: Sequence[float]) -> CostModel:
        """The model with these four coefficients, in `COST_FEATURES` order (a, b, c, d)."""
        return cls(**dict(zip(COST_FEATURES, (float(v) for v in values), strict=True)))

    @classmethod
    def dense(
        cls,
        *,
        hidden_size: int,
        num_layers: int,
        vision_hidden_size: int = 0,
        vision_layers: int = 0,
        vision_full_attention_layers: int | None = None,
        vision_window_patches: int = 0,
        language_attention_by_sample: bool = True,
    ) -> CostModel:
        """FLOP-count coefficients of a dense-attention language model (and ViT), per text-token unit.

        `vision_full_attention_layers`: how many ViT layers attend over each whole image (default: all); the
        other layers attend within windows of `vision_window_patches` patches (Qwen2.5-VL: 4 of 32 layers
        full, windows of 8 x 8 patches), which costs per patch, not per squared image size.
        `language_attention_by_sample=False`: the language model's attention spans the whole sequence
        whatever the samples (a dense [seq, seq] block mask, as megatron-core's local attention does), so
        its cost is the same for every bin and `sum_sq_seq_len` is 0.
        """
        full = vision_layers if vision_full_attention_layers is None else vision_full_attention_layers
        if hidden_size < 1 or num_layers < 1 or vision_hidden_size < 0 or vision_layers < 0:
            raise ValueError("hidden sizes and layer counts must be positive (vision ones >= 0)")
        if not 0 <= full <= vision_layers or vision_window_patches < 0:
            raise ValueError(
                f"vision_full_attention_layers must be in [0, vision_layers={vision_layers}] and "
                f"vision_window_patches >= 0, got {full} and {vision_window_patches}"
            )
        unit = 72.0 * hidden_size**2 * num_layers
        windowed = vision_layers - full
        return cls(
            tokens=1.0,
            sum_sq_seq_len=6.0 * hidden_size * num_layers / unit if language_attention_by_sample else 0.0,
            image_patches=(
                72.0 * vision_hidden_size**2 * vision_layers
                + 12.0 * vision_hidden_size * vision_window_patches * windowed
            )
            / unit,
            sum_sq_image_patches=12.0 * vision_hidden_size * full / unit,
        )

    @classmethod
    def fit(cls, features: np.ndarray, times_s: np.ndarray) -> CostModel:
        """Non-negative least-squares coefficients from measurements.

        Args:
            features: [m, 4], the summed features of the bins behind each measurement (e.g. one rank's
                micro-batches in one step).
            times_s: [m], the measured compute times.
        Features that never vary the time (all zero) get coefficient 0.
        """
        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(times_s, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != len(COST_FEATURES) or y.shape != (len(x),):
            raise ValueError(f"features must be [m, 4] and times_s [m], got {x.shape} and {y.shape}")
        if len(x) < 1 or not (np.isfinite(x).all() and np.isfinite(y).all()):
            raise ValueError("fit needs at least one measurement, all finite")
        scale = np.where(np.abs(x).max(axis=0) > 0, np.abs(x).max(axis=0), 1.0)
        best: tuple[float, np.ndarray] | None = None
        # Four features: every subset of them solved by least squares; the best non-negative solution wins.
        for size in range(1, len(COST_FEATURES) + 1):
            for subset in itertools.combinations(range(len(COST_FEATURES)), size):
                cols = list(subset)
                solution = np.linalg.lstsq(x[:, cols] / scale[cols], y, rcond=None)[0]
                if (solution < 0).any() or not solution.any():
                    continue
                coefficients = np.zeros(len(COST_FEATURES))
                coefficients[cols] = solution / scale[cols]
                residual = float(np.sum((x @ coefficients - y) ** 2))
                if best is None or residual < best[0] - 1e-12 * max(1.0, residual):
                    best = (residual, coefficients)
        if best is None:
            raise ValueError("no non-negative cost model fits these measurements (are the times positive?)")
        return cls.from_coefficients(best[1].tolist())


DEFAULT_COST_MODEL = CostModel.dense(
    hidden_size=3584, num_layers=28, vision_hidden_size=1280, vision_layers=32
)
