"""Compute cost of a packed bin: a linear model over four per-bin features.

    cost = a * tokens + b * sum(sample_len^2) + c * image_patches + d * sum(image_patches^2)

`tokens` is the bin's token count (text and image-pad tokens), `sum(sample_len^2)` drives the attention
score work of block-diagonal causal attention, `image_patches` the vision tower's per-patch work (patches
before the merge, t*h*w per image) and `sum(image_patches^2)` its full attention within each image.

The coefficients that count FLOPs come from one formula, `forward_flop_model`: the forward FLOPs of a bin
(a multiply-add counts 2) of a model given by its dimensions (`ModelFlopShape`), linear in the four features.
Per token: 2 * L * (h * (q + 2 kv) + q * h + m * h * f) + 2 * h * V (QKV with query width q and key/value
width kv, output projection, an MLP of m = 3 (gated) or 2 matrices of width f, logits; a mixture of experts
counts the k experts each token runs, k * m * h * f, plus its router over E experts, h * E); causal attention
within each sample of n tokens, n (n + 1) / 2 pairs of 4 * q FLOPs per layer, gives 2 * q * L to `tokens` and
to `sum_sq_seq_len`. Per patch of the vision tower: the patch embedding 2 * (pixels per patch) * hv, its
layers 2 * Lv * (4 hv^2 + m * hv * fv), windowed attention 4 * hv * W per patch and windowed layer (counted
as full windows of W patches: an upper bound for edge windows), each merger 2 * (k hv * k hv + k hv * h) /
k with k = merge_size^2; full attention over each image (each temporal patch of a video) of m patches,
4 * hv * m^2 per full-attention layer, in `sum_sq_image_patches`. The trainer's MFU counts 3x this (forward
+ backward) and `--balance compute` evens it out over DP ranks: one count for both, from its model family
(`mmpack.trainer.models.protocol.ModelFamily.flop_model`).

`CostModel.dense` is the same formula for a GPT-shaped model (multi-head attention, a 4h MLP of two
matrices, logits not counted) in units of one text token's dense-layer work, 72 * h^2 * L for training:
a = 1 + 1 / (12 h), b = 1 / (12 h); for a ViT of hidden size hv and Lv layers with full attention per
image, c = hv^2 * Lv / (h^2 * L) and d = 12 * hv * Lv / (72 * h^2 * L); windowed layers move their
attention into c. `DEFAULT_COST_MODEL` is Qwen2.5-VL-7B's shape (h 3584, L 28, hv 1280, Lv 32) counted with
full attention in every ViT layer, an upper bound on the image attention. Measured step times give better
coefficients: `CostModel.fit`.
"""

from __future__ import annotations

import dataclasses
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

    def scaled(self, factor: float) -> CostModel:
        """The same model with every coefficient times `factor` (> 0): the same balance, other units."""
        return CostModel.from_coefficients((self.coefficients * factor).tolist())

    def per_cp_rank(self, cp_size: int) -> CostModel:
        """The work of one of ``cp_size`` context-parallel ranks holding a bin: its 1/CP share of the language
        model's tokens and (load-balanced, `mmpack.packing.context_parallel`) causal attention, and the whole
        vision tower, which every CP rank runs on all the bin's images."""
        if cp_size < 1:
            raise ValueError(f"CP size must be >= 1, got {cp_size}")
        return dataclasses.replace(
            self, tokens=self.tokens / cp_size, sum_sq_seq_len=self.sum_sq_seq_len / cp_size
        )

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
        h, hv = hidden_size, vision_hidden_size
        language = LanguageFlopShape(
            hidden_size=h, num_layers=num_layers, attention_size=h, kv_size=h, ffn_hidden_size=4 * h,
            gated_mlp=False,
        )  # fmt: skip
        vision = VisionFlopShape(
            hidden_size=hv, num_layers=vision_layers, ffn_hidden_size=4 * hv, gated_mlp=False,
            full_attention_layers=full, window_patches=vision_window_patches, mergers=0,
        )  # fmt: skip
        shape = ModelFlopShape(language=language, vision=vision if vision_layers else None)
        forward = forward_flop_model(shape, attention_by_sample=language_attention_by_sample)
        return forward.scaled(3.0 / (72.0 * h * h * num_layers))

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


@dataclass(kw_only=True, frozen=True)
class LanguageFlopShape:
    """The dimensions of a language model that its FLOPs depend on (see the module docstring)."""

    hidden_size: int
    num_layers: int
    attention_size: int  # query heads x head size
    kv_size: int  # key/value groups x head size
    ffn_hidden_size: int
    gated_mlp: bool = True  # SwiGLU: three matrices
    vocab_size: int = 0  # the logits' FLOPs; 0: not counted
    # mixture of experts: each token runs `experts_per_token` expert MLPs of width `ffn_hidden_size` and
    # a router over `num_experts`; 0: a dense MLP
    experts_per_token: int = 0
    num_experts: int = 0

    def __post_init__(self) -> None:
        if (self.experts_per_token > 0) != (
            self.num_experts > 0
        ) or self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token {self.experts_per_token} must be in 1..num_experts {self.num_experts} "
                "(both 0 for a dense MLP)"
            )


@dataclass(kw_only=True, frozen=True)
class VisionFlopShape:
    """The dimensions of a vision tower and its merger(s) that their FLOPs depend on."""

    hidden_size: int
    num_layers: int
    ffn_hidden_size: int
    gated_mlp: bool = True
    patch_pixels: int = 0  # values per patch (channels x temporal patch x patch^2); 0: embedding not counted
    full_attention_layers: int | None = None  # layers attending over whole images (None: all)
    window_patches: int = 0  # patches per window of the other layers
    merge_units: int = 4  # patches merged into one token (merge_size^2)
    out_hidden_size: int = 0  # the merger's output width (the language model's hidden size)
    mergers: int = 1  # patch mergers run on every merged token (1 + DeepStack mergers)

    def __post_init__(self) -> None:
        full = self.num_layers if self.full_attention_layers is None else self.full_attention_layers
        if not 0 <= full <= self.num_layers or self.window_patches < 0:
            raise ValueError(
                f"full_attention_layers must be in [0, {self.num_layers}] and window_patches >= 0, got "
                f"{full} and {self.window_patches}"
            )


@dataclass(kw_only=True, frozen=True)
class ModelFlopShape:
    """A vision-language model for the FLOP count: its language model and vision tower (if any)."""

    language: LanguageFlopShape
    vision: VisionFlopShape | None = None


def forward_flop_model(shape: ModelFlopShape, *, attention_by_sample: bool = True) -> CostModel:
    """Forward FLOPs of a bin, as a cost model over its features (the formula of the module docstring).

    `attention_by_sample=False`: the language model attends over the whole sequence whatever its samples
    (a dense block mask), so its attention costs the same in every bin and is left out.
    """
    lang = shape.language
    h, q, kv, layers = lang.hidden_size, lang.attention_size, lang.kv_size, lang.num_layers
    mlp = (3 if lang.gated_mlp else 2) * h * lang.ffn_hidden_size * max(1, lang.experts_per_token)
    mlp += h * lang.num_experts  # the router's logits
    tokens = 2.0 * layers * (h * (q + 2 * kv) + q * h + mlp) + 2.0 * h * lang.vocab_size
    causal = 2.0 * q * layers if attention_by_sample else 0.0  # n (n + 1) / 2 pairs x 4 q x L
    patches = squares = 0.0
    v = shape.vision
    if v is not None:
        hv, k = v.hidden_size, v.merge_units
        full = v.num_layers if v.full_attention_layers is None else v.full_attention_layers
        v_mlp = (3 if v.gated_mlp else 2) * hv * v.ffn_hidden_size
        patches = 2.0 * v.patch_pixels * hv + 2.0 * v.num_layers * (4 * hv * hv + v_mlp)
        patches += 4.0 * hv * v.window_patches * (v.num_layers - full)
        if v.mergers:
            patches += v.mergers * 2.0 * (k * hv * k * hv + k * hv * v.out_hidden_size) / k
        squares = 4.0 * hv * full
    return CostModel(tokens=tokens + causal, sum_sq_seq_len=causal, image_patches=patches,
                     sum_sq_image_patches=squares)  # fmt: skip


DEFAULT_COST_MODEL = CostModel.dense(
    hidden_size=3584, num_layers=28, vision_hidden_size=1280, vision_layers=32
)
