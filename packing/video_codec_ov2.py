"""LLaVA-OneVision-2's codec-stream video: the rules that turn a video's codec canvases (`cv-preinfer`'s output)
into model inputs and exact tokens, and the blob a packed dataset stores per codec video.

A `cv-preinfer` output folder holds the canvases (`canvas_000.jpg`, ... in model order: per group of frames one
full frame, then canvases packed with its frames' highest-bit-cost 2 x 2 patch blocks), `src_patch_position.npy`
(int [n_canvas * hb * wb, 3]: each patch's source (frame, row, column), row-major per canvas, -1 for padding) and
`meta.json` (`fps`). The model side, as LLaVA-OneVision-2's codec processor does it:

    canvases all padding are dropped; a canvas partly padding is refused
    positions  = per canvas, reordered into merge-block order (2 x 2 blocks contiguous, as the patches)
    grid       = one row [N, H / patch, W / patch] for the video's N canvases (the tower's frame windows then
                 hold one group of canvases); tokens = N * H * W / (patch * 2)^2
    runs       = the runs of equal source frame t over the block-ordered positions, each of count / 4 tokens
    text       = the video block <|vision_start|><|video_pad|><|vision_end|> and the newline after it become,
                 per run, <{t / fps:.1f} seconds><|vision_start|> + count / 4 <|image_pad|> + <|vision_end|>\\n

Everything here is numpy only (no torch, no file reading: `mmpack.offline_packing.inputs.codec_assets` reads
the folders, `mmpack.dataloader.codec_video` decodes the blob).
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmpack.packing.errors import MmpackError

CODEC_FORMAT = (
    "ov2codec"  # the video format of a codec video in a packed dataset (its blob, `pack_codec_blob`)
)
MERGE_SIZE = 2  # the preprocessor packs 2 x 2 patch blocks: only a 2 x 2 merge keeps a block one token
NEWLINE = "\n"


class CodecAssetError(MmpackError, ValueError):
    """Codec assets that do not fit the model side (`reason` "codec_video"); the message names what to fix."""

    default_reason = "codec_video"


def timestamp_text(seconds: float) -> str:
    """The text before a frame's (or a run's) tokens in LLaVA-OneVision-2's video blocks."""
    return f"<{seconds:.1f} seconds>"


@dataclass(frozen=True)
class CodecCanvases:
    """A codec video's checked assets: the canvases kept (indices into the folder's), their size, the
    block-ordered source positions of their patches, and the video's frame rate."""

    kept: tuple[int, ...]
    canvas_hw: tuple[int, int]
    positions: np.ndarray  # int64 [len(kept) * gh * gw, 3], merge-block order
    fps: float

    def runs(self) -> list[tuple[int, int]]:
        """(source frame t, tokens) per run of equal t over the block-ordered positions."""
        return timestamp_runs(self.positions)


def check_canvases(
    sizes_wh: Sequence[tuple[int, int]], src_positions: np.ndarray, fps: Any, *, patch_size: int, name: str
) -> CodecCanvases:
    """The checked assets of one codec video (CodecAssetError naming `name` where they do not fit): canvases of
    one size in whole 2 x 2 blocks of `patch_size` patches, positions [n_canvas * patches, 3] of integers,
    a canvas all padding (dropped) or none, 2 x 2 blocks of one source frame each, and a positive fps."""
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not fps > 0 or not np.isfinite(fps):
        raise CodecAssetError(
            f"codec video {name}: meta.json has no positive fps (got {fps!r}); rerun cv-preinfer"
        )
    if not sizes_wh:
        raise CodecAssetError(f"codec video {name}: no canvases")
    if len(set(sizes_wh)) != 1:
        raise CodecAssetError(
            f"codec video {name}: canvases of sizes {sorted(set(sizes_wh))} (w x h): one grid row needs one size"
        )
    w, h = sizes_wh[0]
    side = patch_size * MERGE_SIZE
    if w % side or h % side:
        raise CodecAssetError(
            f"codec video {name}: canvas {w}x{h} (w x h) is not whole {side}-pixel blocks (patch {patch_size}, "
            f"merge {MERGE_SIZE}); make the canvases with --patch {patch_size}"
        )
    gh, gw, n = h // patch_size, w // patch_size, len(sizes_wh)
    pos = np.asarray(src_positions)
    if pos.dtype.kind not in "iu" or pos.ndim != 2 or pos.shape != (n * gh * gw, 3):
        raise CodecAssetError(
            f"codec video {name}: src_patch_position.npy is {pos.dtype} {pos.shape}, its {n} canvases of "
            f"{gh}x{gw} patches need integers of shape ({n * gh * gw}, 3)"
        )
    per_canvas = pos.astype(np.int64).reshape(n, gh * gw, 3)
    real = per_canvas[..., 0] >= 0
    partly = np.flatnonzero(real.any(axis=1) & ~real.all(axis=1))
    if len(partly):
        raise CodecAssetError(
            f"codec video {name}: canvas {int(partly[0])} is partly padding (t = -1 for some patches only); "
            "the model side drops whole padding canvases only"
        )
    kept = np.flatnonzero(real.all(axis=1))
    if not len(kept):
        raise CodecAssetError(f"codec video {name}: every canvas is padding")
    ordered = block_order(per_canvas[kept], gh, gw)
    if (ordered.reshape(-1, MERGE_SIZE**2, 3)[..., 0] != ordered[:: MERGE_SIZE**2, None, 0]).any():
        raise CodecAssetError(
            f"codec video {name}: a {MERGE_SIZE}x{MERGE_SIZE} patch block mixes source frames; the positions do "
            "not match the canvases"
        )
    return CodecCanvases(tuple(int(k) for k in kept), (h, w), ordered, float(fps))


def block_order(per_canvas: np.ndarray, gh: int, gw: int) -> np.ndarray:
    """int64 [n * gh * gw, 3]: row-major positions [n, gh * gw, 3] of each canvas in merge-block order."""
    m = MERGE_SIZE
    n = per_canvas.shape[0]
    blocks = per_canvas.reshape(n, gh // m, m, gw // m, m, 3).transpose(0, 1, 3, 2, 4, 5)
    return np.ascontiguousarray(blocks).reshape(-1, 3).astype(np.int64)


def timestamp_runs(positions: np.ndarray) -> list[tuple[int, int]]:
    """(t, tokens) per run of equal source frame t over block-ordered `positions` (4 patches a token)."""
    t = np.asarray(positions)[:, 0]
    if not len(t):
        return []
    starts = np.concatenate([[0], np.flatnonzero(np.diff(t)) + 1])
    counts = np.diff(np.append(starts, len(t)))
    return [(int(t[a]), int(c) // MERGE_SIZE**2) for a, c in zip(starts, counts)]


def plan_fields(codec: Mapping[str, Any], *, patch_size: int, merge_size: int) -> dict[str, Any]:
    """`mmpack.packing.video_tokens.VideoPlan` fields of a scanned codec video (`codec`: the scan's summary,
    `codec_summary`): frame_indices and timestamps_s per run, one grid row for all canvases; CodecAssetError
    where the rule's patch or merge size is not the assets'."""
    if merge_size != MERGE_SIZE or int(codec["patch_size"]) != patch_size:
        raise CodecAssetError(
            f"codec canvases of patch {codec['patch_size']} in {MERGE_SIZE}x{MERGE_SIZE} blocks, the model merges "
            f"{merge_size}x{merge_size} patches of {patch_size}: the canvases fit only patch {patch_size} merge "
            f"{MERGE_SIZE}"
        )
    h, w = (int(v) for v in codec["canvas_hw"])
    fps = float(codec["fps"])
    runs = [(int(t), int(n)) for t, n in codec["runs"]]
    grid = (len(codec["kept"]), h // patch_size, w // patch_size)
    num_tokens = grid[0] * grid[1] * grid[2] // merge_size**2
    if sum(n for _, n in runs) != num_tokens:  # the scan's own summary: a changed or damaged work folder
        raise ValueError(f"codec runs of {sum(n for _, n in runs)} tokens for a grid of {num_tokens}")
    return {
        "frame_indices": tuple(t for t, _ in runs),
        "resized_hw": (h, w),
        "grid_thw": grid,
        "num_tokens": num_tokens,
        "sample_fps": fps,
        "second_per_grid_t": 1.0 / fps,
        "frame_count_exact": True,
        "video_fps": fps,
        "timestamps_s": tuple(float(t) / fps for t, _ in runs),
        "run_tokens": tuple(n for _, n in runs),
    }


def codec_summary(canvases: CodecCanvases, *, patch_size: int) -> dict[str, Any]:
    """The JSON-ready summary the scan records per codec video (what `plan_fields` reads)."""
    return {
        "kept": list(canvases.kept),
        "canvas_hw": list(canvases.canvas_hw),
        "patch_size": patch_size,
        "fps": canvases.fps,
        "runs": [list(r) for r in canvases.runs()],
    }


def block_ids(tokenizer: Any, plan: Any) -> np.ndarray:
    """The ids that replace a codec video's <|vision_start|><|video_pad|><|vision_end|>: one block per run (see
    the module docstring), the last without its newline: the newline after the video block in the text stands
    for it (the packer checks there is one, `VideoStyle.trailing_text`), so the text after is encoded as the
    processor's rewrite leaves it."""
    ids = tokenizer.special_ids
    newline = tokenizer.encode(NEWLINE)
    out: list[int] = []
    for k, (seconds, n) in enumerate(zip(plan.timestamps_s, plan.run_tokens)):
        out += tokenizer.encode(timestamp_text(seconds))
        out += [ids["vision_start"], *[ids["image_pad"]] * n, ids["vision_end"]]
        if k + 1 < len(plan.run_tokens):
            out += newline
    return np.asarray(out, dtype=np.uint32)


def pack_codec_blob(canvases: Sequence[bytes], formats: Sequence[str], positions: np.ndarray) -> bytes:
    """The one file a packed dataset stores per codec video: an uncompressed `.npz` (no pickles) of the kept
    canvases' files as read (`canvas_000`, ... uint8, never re-encoded), their formats and the block-ordered
    positions (int32 [P, 3])."""
    arrays: dict[str, np.ndarray] = {
        f"canvas_{i:03d}": np.frombuffer(data, dtype=np.uint8) for i, data in enumerate(canvases)
    }
    arrays["formats"] = np.asarray(list(formats), dtype="U8")
    arrays["positions"] = np.asarray(positions, dtype=np.int32).reshape(-1, 3)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy types its keyword arrays with allow_pickle
    return buf.getvalue()


def read_codec_blob(data: bytes | bytearray | memoryview, name: str) -> tuple[list[bytes], np.ndarray]:
    """The canvases' files and the block-ordered positions (int64 [P, 3]) of a `pack_codec_blob` blob."""
    try:
        with np.load(io.BytesIO(bytes(data)), allow_pickle=False) as z:
            n = sum(1 for k in z.files if k.startswith("canvas_"))
            canvases = [z[f"canvas_{i:03d}"].tobytes() for i in range(n)]
            positions = z["positions"].astype(np.int64).reshape(-1, 3)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:  # a truncated blob: BadZipFile
        raise CodecAssetError(
            f"codec video {name}: not a codec blob of this dataset ({exc}); repack"
        ) from None
    return canvases, positions


def fold_canvas_tags(
    messages: Sequence[tuple[str, str]], num_canvases: int, *, name: str
) -> tuple[tuple[str, str], ...]:
    """The messages of LLaVA-OneVision-2's training form of a codec video (one `<image>` per canvas) with the
    canvases' tags made the one `<video>` of the folder form: the model's rewrite replaces the span from the first
    canvas's block to the last's, so the tags must be in one message with only white space between them."""
    from mmpack.packing.chat import IMAGE_TAG, VIDEO_TAG  # here: the loader's workers import this module

    found = [k for k, (_, text) in enumerate(messages) if IMAGE_TAG in text]
    counts = [messages[k][1].count(IMAGE_TAG) for k in found]
    if len(found) != 1 or counts[0] != num_canvases:
        raise CodecAssetError(
            f"codec video {name}: {sum(counts)} <image> tags in {len(found)} messages for {num_canvases} canvases; "
            "the training form has one <image> per canvas, all in one message"
        )
    role, text = messages[found[0]]
    first, last = text.index(IMAGE_TAG), text.rindex(IMAGE_TAG) + len(IMAGE_TAG)
    if text[first:last].replace(IMAGE_TAG, "").strip():
        raise CodecAssetError(
            f"codec video {name}: text between the canvases' <image> tags (the model's rewrite drops it); keep the "
            "tags together"
        )
    out = list(messages)
    out[found[0]] = (role, text[:first] + VIDEO_TAG + text[last:])
    return tuple(out)
