"""Turns the bin records of one micro-batch into a `mmpack.packing.batch.MicroBatch` (numpy; torch only in
loader.py).

Images are decoded with Pillow; videos (format version 3 datasets) by `mmpack.dataloader.video`, which decodes only
the frames the offline plan recorded, in the worker that collates.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from mmpack.dataloader.codec_video import load_codec_video
from mmpack.dataloader.readers import BinRecord
from mmpack.dataloader.video import VideoPixels, collate_videos, load_video
from mmpack.packing.batch import DroppedSample, MicroBatch, PositionRule
from mmpack.packing.errors import MmpackError
from mmpack.packing.format import DEFAULT_MAX_IMAGE_PIXELS
from mmpack.packing.image_tokens import ImageTokenRule, image_to_patches
from mmpack.packing.layout import IGNORE_INDEX, block_mask, build_labels, build_position_ids, segment_ids
from mmpack.packing.patch_positions import block_patch_positions
from mmpack.packing.video_tokens import VideoPlan

if TYPE_CHECKING:
    from mmpack.dataloader.manifest import Manifest


@dataclass(kw_only=True, frozen=True)
class CollateConfig:
    """What collation needs from the manifest, plus the attention-mask switch."""

    seq_len: int
    pad_id: int
    image_pad_id: int
    rule: ImageTokenRule
    build_attention_mask: bool = False
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS  # the manifest's image_rule.max_image_pixels
    video_pad_id: int = -1  # the manifest's <|video_pad|> id (-1: the tokenizer has none)
    position_rule: PositionRule | None = None  # the model family's positions (None: restart per sample)
    # the videos' frames are images in `<|image_pad|>` blocks (a video style with `frames_as_images`, e.g.
    # llava_onevision2's): they go into `pixel_values` / `image_grid_thw` in token order, one [1, h, w] grid per frame
    frames_as_images: bool = False
    # a mixture: each source's own config by source id (its image rule, pixel limit and video style decode its
    # bins); the fields above are what every source shares (`mixture.check_sources`)
    sources: tuple[CollateConfig, ...] = ()
    # a sample whose media cannot be decoded stops the loader (`BadSampleError`) instead of being dropped from
    # its bin (labels masked, media blank); read from the config `collate_bins` is given, not a source's
    strict_data: bool = False

    @classmethod
    def from_manifest(
        cls,
        manifest: Manifest,
        *,
        build_attention_mask: bool = False,
        position_rule: PositionRule | None = None,
    ) -> CollateConfig:
        """The collation of a packed dataset: its length, pad ids, image rule and pixel limit."""
        return cls(
            seq_len=manifest.seq_len,
            pad_id=manifest.pad_id,
            image_pad_id=manifest.image_pad_id,
            rule=manifest.image_rule,
            build_attention_mask=build_attention_mask,
            max_image_pixels=manifest.max_image_pixels,
            video_pad_id=manifest.video_pad_id,
            position_rule=position_rule,
            frames_as_images=manifest.dataset.video_rule is not None
            and manifest.dataset.video_rule.kind.frames_as_images,
        )


class ImageTooLargeError(ValueError):
    """An image over the dataset's pixel limit, found from its header before decoding; `row` is its bin's
    index in the micro-batch."""

    def __init__(self, message: str, row: int = -1):
        super().__init__(message)
        self.row = row


class BadSampleError(MmpackError, ValueError):
    """A sample whose media cannot be decoded, under `CollateConfig.strict_data`; one line naming the sample,
    its bin and the medium."""

    default_reason = "bad_sample"


@dataclass(frozen=True)
class MediaFailure:
    """One medium of a bin that could not be decoded: `kind` "image" or "video", its index among the bin's
    images or videos, how it is named and why it failed (one line)."""

    kind: str
    index: int
    media: str
    error: str


@dataclass(frozen=True)
class BlankMedium:
    """A video frame whose video could not be decoded, put among a bin's images (`_frames_into_images`): its
    patches are blank and its sample is dropped."""

    failure: MediaFailure


def one_line(error: BaseException) -> str:
    """An error's message on one line (its type where it has none)."""
    return " ".join(str(error).split()) or type(error).__name__


def decode_image_patches(
    data: bytes,
    grid_thw: np.ndarray,
    rule: ImageTokenRule,
    *,
    max_pixels: int | None = None,
    where: str = "image",
) -> np.ndarray:
    """Decodes encoded image bytes with Pillow and returns its patches at the stored grid; an image over
    `max_pixels` is refused from its header (Image.open reads only that), before any decoding."""
    with Image.open(io.BytesIO(data)) as img:
        width, height = img.size
        if max_pixels is not None and width * height > max_pixels:
            raise ImageTooLargeError(
                f"{where} is {width}x{height} ({width * height} pixels), over the dataset's limit of "
                f"{max_pixels} pixels (manifest image_rule.max_image_pixels); repack the data with "
                "mmpack pack, which rejects such images"
            )
        img.load()
        t, gh, gw = (int(v) for v in grid_thw)
        return image_to_patches(img, rule, grid_thw=(t, gh, gw))


def collate_bins(
    records: Sequence[BinRecord],
    cfg: CollateConfig,
    pixel_out: Callable[[int, int], np.ndarray] | None = None,
    bin_ids: np.ndarray | None = None,
    source_ids: np.ndarray | None = None,
) -> MicroBatch[np.ndarray]:
    """One micro-batch, as numpy: the packed layout of every bin, its positions and the image patches.

    Each row is laid out by the rules of `mmpack.packing.layout` (labels, positions, mask) straight into the
    batch arrays, so the result equals `collate_packed` over `build_packed_sequence` of each bin (checked by
    the tests); positions are the config's position rule's where it has one. Each image's patches go
    straight into `pixel_values`, sized from the grids before decoding, so a batch never holds its patches
    twice; `pixel_out(rows, width)` may provide that float32 array (a loader worker hands out shared memory,
    so the patches need no copy on their way to the consumer). `bin_ids`: the records' global bin indices,
    `source_ids`: the index of each record's source in the loader's mixture (zeros for one dataset), whose config
    in `cfg.sources` decodes it.
    """
    if not records:
        raise ValueError("collate_bins needs at least one bin")
    b, length = len(records), cfg.seq_len
    width = cfg.rule.patch_dim
    row_cfgs = _row_configs(cfg, source_ids, b)
    if any(c.frames_as_images for c in row_cfgs):  # each video frame an image, in token order
        flat = [
            _frames_into_images(rec, c) if c.frames_as_images else _as_is(rec)
            for rec, c in zip(records, row_cfgs)
        ]
        plain = replace(
            cfg,
            frames_as_images=False,
            sources=tuple(replace(c, frames_as_images=False) for c in cfg.sources),
        )
        batch = collate_bins([r for r, _ in flat], plain, pixel_out, bin_ids, source_ids)
        return _with_frame_times(batch, [t for _, ts in flat for t in ts])
    grids = [_checked_grids(rec) for rec in records]
    n_rows = sum(int(np.prod(g, axis=1).sum()) for g in grids)
    pixels = (
        np.zeros((0, width), dtype=np.float32)
        if n_rows == 0
        else pixel_out(n_rows, width)
        if pixel_out is not None
        else np.empty((n_rows, width), dtype=np.float32)
    )
    row_at = 0
    tokens = np.full((b, length), cfg.pad_id, dtype=np.int64)
    labels = np.full((b, length), IGNORE_INDEX, dtype=np.int64)
    segments: list[np.ndarray] = []  # per row: its segment lengths, padding included
    videos: list[list[VideoPixels]] = []
    dropped: list[DroppedSample] = []
    num_real = 0
    for row, rec in enumerate(records):
        ids, mask, lens = _checked_row(rec, length)
        total = int(ids.shape[0])
        tokens[row, :total] = ids
        build_labels(
            ids, mask, lens, ignore_ids=(cfg.image_pad_id, cfg.video_pad_id), out=labels[row, :total]
        )
        segments.append(lens if total == length else np.append(lens, length - total))
        num_real += total
        _check_image_pads(rec, ids, grids[row], row_cfgs[row])
        failures: list[MediaFailure] = []
        for i, (data, g) in enumerate(zip(rec["images"], grids[row])):
            where = f"bin {rec['key']} image {i}"
            if isinstance(data, np.ndarray):  # a video frame's patches (`_frames_into_images`)
                pixels[row_at : row_at + len(data)] = data
                row_at += len(data)
                continue
            n = int(np.prod(g))
            if isinstance(data, BlankMedium):  # a frame of a video that could not be decoded
                failures.append(replace(data.failure, kind="image", index=i))
                pixels[row_at : row_at + n] = 0.0
                row_at += n
                continue
            try:
                rc = row_cfgs[row]  # the bin's own source's rule and pixel limit
                patches = decode_image_patches(data, g, rc.rule, max_pixels=rc.max_image_pixels, where=where)
            except ImageTooLargeError as e:
                raise ImageTooLargeError(str(e), row=row) from None
            except MemoryError:
                raise
            except Exception as e:  # a damaged file: the sample is dropped below (or stops a strict loader)
                failures.append(MediaFailure("image", i, f"image {i} of bin {rec['key']}", one_line(e)))
                patches = np.zeros((n, width), dtype=np.float32)
            pixels[row_at : row_at + len(patches)] = patches
            row_at += len(patches)
        videos.append(decode_bin_videos(rec, ids, row_cfgs[row], failures=failures))
        if failures:  # each sample with a medium that failed: no loss, its media blank
            dropped += drop_samples(
                rec, row, ids, lens, failures, row_cfgs[row], labels[row], cfg.strict_data
            )
    if row_at != n_rows:  # the grids said how many; decode_image_patches makes that many per image
        raise ValueError(f"bins {[rec['key'] for rec in records]}: {row_at} patch rows, grids need {n_rows}")
    vision = collate_videos([v for row in videos for v in row])
    cu = np.concatenate([[0], np.cumsum(np.concatenate(segments))]).astype(np.int32)
    image_grids = np.concatenate(grids) if n_rows else np.zeros((0, 3), dtype=np.int64)
    return MicroBatch(
        tokens=tokens,
        labels=labels,
        loss_mask=(labels != IGNORE_INDEX).astype(np.float32),
        position_ids=_positions(cfg.position_rule, tokens, segments, grids, videos),
        cu_seqlens=cu,
        max_seqlen=max(int(s.max()) for s in segments),
        num_real_tokens=num_real,
        pixel_values=pixels,
        image_grid_thw=image_grids,
        pixel_values_videos=vision["pixel_values_videos"]
        if len(vision["video_grid_thw"])
        else np.zeros((0, width), dtype=np.float32),
        video_grid_thw=vision["video_grid_thw"],
        second_per_grid_ts=vision["second_per_grid_ts"],
        bin_ids=None if bin_ids is None else np.asarray(bin_ids, dtype=np.int64),
        source_ids=None if source_ids is None else np.asarray(source_ids, dtype=np.int64),
        attention_mask=np.stack([block_mask(segment_ids(s))[None] for s in segments])
        if cfg.build_attention_mask
        else None,
        patch_positions=None if cfg.position_rule is None else cfg.position_rule.patch_positions(image_grids),
        dropped=tuple(dropped),
    )


def _row_configs(cfg: CollateConfig, source_ids: np.ndarray | None, rows: int) -> list[CollateConfig]:
    """The config each row is decoded by: its source's in a mixture, else `cfg`."""
    if not cfg.sources:
        return [cfg] * rows
    if source_ids is None or len(source_ids) != rows:
        raise ValueError(f"a mixture's collate config needs the source of each of the {rows} bins")
    return [cfg.sources[int(s)] for s in source_ids]


def drop_samples(
    rec: BinRecord,
    row: int,
    ids: np.ndarray,
    lens: np.ndarray,
    failures: list[MediaFailure],
    cfg: CollateConfig,
    labels: np.ndarray,
    strict: bool,
) -> list[DroppedSample]:
    """Drops from one bin each sample holding a medium that failed (its media are blank already): its labels in
    `labels` (the bin's row) are masked, so it adds no loss and no gradient, and the bin keeps its layout.
    `strict`: BadSampleError naming the first such sample instead."""
    ends = np.cumsum(lens)
    out: dict[int, DroppedSample] = {}
    for f in failures:
        for k in _owners(rec, ids, ends, f, cfg):
            sid = str(rec["sample_ids"][k]) if k < len(rec["sample_ids"]) else f"#{k}"
            if strict:
                raise BadSampleError(
                    f"sample {sid!r} (bin {rec['key']}): {f.media} cannot be decoded: {f.error} "
                    "(--strict-data stops here; without it the sample is dropped and training goes on)"
                )
            if k not in out:
                labels[int(ends[k] - lens[k]) : int(ends[k])] = IGNORE_INDEX
                out[k] = DroppedSample(
                    sample_id=sid, bin_key=str(rec["key"]), row=row, media=f.media, error=f.error
                )
    return list(out.values())


def _owners(
    rec: BinRecord, ids: np.ndarray, ends: np.ndarray, f: MediaFailure, cfg: CollateConfig
) -> list[int]:
    """The sample holding a failed medium: the one whose segment holds its first pad (the media's pads come in
    order, each medium its token count of them); every sample of the bin where that cannot be told."""
    if f.kind == "image":
        pad_id = cfg.image_pad_id
        counts = [cfg.rule.tokens_of_grid((int(g[0]), int(g[1]), int(g[2]))) for g in _checked_grids(rec)]
    else:
        pad_id = cfg.video_pad_id
        counts = [int(p["num_tokens"]) for p in rec.get("video_plans", ())]
    pads = np.flatnonzero(ids == pad_id) if pad_id >= 0 else np.zeros(0, dtype=np.int64)
    first = sum(counts[: f.index])
    if first >= len(pads):
        return list(range(len(ends)))
    return [int(np.searchsorted(ends, pads[first], side="right"))]


def _as_is(rec: BinRecord) -> tuple[BinRecord, list[np.ndarray]]:
    """`_frames_into_images` of a bin whose videos stay videos: the record, and t = 0 for its images' patches."""
    return rec, [np.zeros(int(np.prod(g)), dtype=np.int64) for g in _checked_grids(rec)]


def _with_frame_times(batch: MicroBatch[np.ndarray], ts: list[np.ndarray]) -> MicroBatch[np.ndarray]:
    """The batch with each frame's patch positions at t = its index in its video (`ts`: per image or frame,
    what to add to its patches' t, or [P, 3] to their (t, row, column): a codec video's)."""
    if batch.patch_positions is not None and ts:
        batch.patch_positions[:] += np.concatenate([_as_offsets(t) for t in ts])
    return batch


def _as_offsets(t: np.ndarray) -> np.ndarray:
    """[P, 3] offsets of (t, row, column) from per-patch t offsets [P] or offsets [P, 3]."""
    if t.ndim == 2:
        return t
    out = np.zeros((len(t), 3), dtype=np.int64)
    out[:, 0] = t
    return out


def _frames_into_images(rec: BinRecord, cfg: CollateConfig) -> tuple[BinRecord, list[np.ndarray]]:
    """The record with its videos' frames as images (patch arrays beside the images' bytes), in token order,
    and per image or frame the t to add to its patches' frame positions (0, or the frame's index).

    Segment by segment, the next videos are that sample's where their plans name its sample id and their
    frames are its runs of pads (one run per frame); else the next images are, one run each."""
    ids, _, lens = _checked_row(rec, cfg.seq_len)
    stored = list(rec.get("video_plans", ()))
    fails: list[MediaFailure] = []
    decoded = decode_bin_videos(rec, ids, cfg, check_pads=False, failures=fails)
    failed = {f.index: BlankMedium(f) for f in fails}  # a video that failed: each frame a blank medium
    videos = [(VideoPlan.from_dict(e), e.get("sample_id"), px) for e, px in zip(stored, decoded)]
    images = list(zip(rec["images"], _checked_grids(rec)))
    media: list[Any] = []
    grids: list[tuple[int, ...]] = []
    ts: list[np.ndarray] = []
    starts = np.concatenate([[0], np.cumsum(lens)])
    v = i = 0
    for k, sid in enumerate(rec["sample_ids"]):
        runs = _pad_runs(ids[starts[k] : starts[k + 1]], cfg.image_pad_id)
        n_videos, frames = 0, list[int]()
        while len(frames) < len(runs) and v + n_videos < len(videos) and videos[v + n_videos][1] == sid:
            plan = videos[v + n_videos][0]
            frames += list(plan.run_tokens) or [plan.num_tokens // plan.grid_thw[0]] * plan.grid_thw[0]
            n_videos += 1
        if n_videos and frames == runs:
            for vi, (plan, _, px) in enumerate(videos[v : v + n_videos], start=v):
                patches = px.pixel_values_videos
                if px.patch_positions is not None:  # codec canvases: one grid row, their source positions
                    media.append(failed.get(vi, patches))
                    grids.append(tuple(plan.grid_thw))
                    grid = np.asarray([plan.grid_thw])
                    ts.append(px.patch_positions - block_patch_positions(grid, cfg.rule.merge_size))
                    continue
                per_frame = patches.shape[0] // plan.grid_thw[0]
                for f, index in enumerate(plan.frame_indices):
                    media.append(failed.get(vi, patches[f * per_frame : (f + 1) * per_frame]))
                    grids.append((1, plan.grid_thw[1], plan.grid_thw[2]))
                    ts.append(np.full(per_frame, index, dtype=np.int64))
            v += n_videos
            continue
        mine = images[i : i + len(runs)]
        if [int(np.prod(g)) // cfg.rule.merge_size**2 for _, g in mine] != runs:
            raise ValueError(
                f"bin {rec['key']} sample {k}: its {len(runs)} runs of <|image_pad|> are neither its next videos' "
                "frames nor its next images; repack the data"
            )
        for data, g in mine:
            media.append(data)
            grids.append(tuple(int(x) for x in g))
            ts.append(np.zeros(int(np.prod(g)), dtype=np.int64))
        i += len(runs)
    if v != len(videos) or i != len(images):
        raise ValueError(f"bin {rec['key']}: videos or images that none of its samples' blocks take")
    out: dict[str, Any] = {
        k: x for k, x in rec.items() if k not in ("videos", "video_plans", "video_grid_thw")
    }
    out["images"] = media
    out["image_grid_thw"] = np.asarray(grids, dtype=np.int64).reshape(-1, 3)
    return out, ts  # type: ignore[return-value]


def _pad_runs(ids: np.ndarray, pad_id: int) -> list[int]:
    """Lengths of the runs of `pad_id` in `ids`, in order (an image or a frame is one run)."""
    pads = np.concatenate([[0], (ids == pad_id).astype(np.int8), [0]])
    edges = np.diff(pads)
    return (np.flatnonzero(edges == -1) - np.flatnonzero(edges == 1)).tolist()


def _checked_grids(rec: BinRecord) -> np.ndarray:

    grid = np.asarray(rec["image_grid_thw"], dtype=np.int64).reshape(-1, 3)
    if len(grid) != len(rec["images"]):
        raise ValueError(f"bin {rec['key']}: {len(rec['images'])} images but {len(grid)} grids")
    return grid


def _checked_row(rec: BinRecord, length: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(input_ids, loss_mask, seq_lens) of one bin, checked against each other and the row length."""
    ids = np.asarray(rec["input_ids"]).reshape(-1)
    mask = np.asarray(rec["loss_mask"]).reshape(-1)
    lens = np.asarray(rec["seq_lens"], dtype=np.int64).reshape(-1)
    total = int(ids.shape[0])
    if total > length:
        raise ValueError(f"bin {rec['key']} has {total} tokens > seq_len {length}")
    summed = int(lens.sum())
    if mask.shape[0] != total or summed != total:
        raise ValueError(
            f"bin {rec['key']}: input_ids ({total}) and loss_mask ({mask.shape[0]}) must both have "
            f"sum(seq_lens) = {summed} tokens"
        )
    if lens.size and int(lens.min()) < 1:
        raise ValueError(f"bin {rec['key']}: seq_lens must all be >= 1, got {lens.tolist()}")
    return ids, mask, lens


def _check_image_pads(rec: BinRecord, ids: np.ndarray, grid: np.ndarray, cfg: CollateConfig) -> None:
    if len(grid):
        expected_pads = sum(cfg.rule.tokens_of_grid(tuple(g)) for g in grid)
        got_pads = int(np.count_nonzero(ids == cfg.image_pad_id))
        if got_pads != expected_pads:
            raise ValueError(
                f"bin {rec['key']}: {got_pads} <|image_pad|> tokens, its images need {expected_pads}"
            )


def _positions(
    rule: PositionRule | None,
    tokens: np.ndarray,
    segments: list[np.ndarray],
    grids: list[np.ndarray],
    videos: list[list[VideoPixels]],
) -> np.ndarray:
    """[B, L] positions restarting per segment (no rule), else the rule's [A, B, L], row by row."""
    if rule is None:
        return np.stack([build_position_ids(s) for s in segments])
    rows = []
    for row, segs in enumerate(segments):
        vids = videos[row]
        rows.append(
            rule.positions(
                tokens[row],
                segs,
                grids[row],
                np.asarray([v.video_grid_thw for v in vids], dtype=np.int64).reshape(-1, 3),
                np.asarray([v.second_per_grid_t for v in vids], dtype=np.float32),
            )
        )
    return np.stack(rows, axis=1)


def decode_bin_videos(
    rec: BinRecord,
    ids: np.ndarray,
    cfg: CollateConfig,
    *,
    check_pads: bool = True,
    failures: list[MediaFailure] | None = None,
) -> list[VideoPixels]:
    """The planned frames of each video of one bin, as model inputs; checks plans, grids and (`check_pads`)
    the `<|video_pad|>` count. Given `failures`, a video that cannot be decoded is blank (its planned grid of
    zero patches) and noted there; else its error is raised."""
    stored = rec.get("video_plans", ())
    plans = [VideoPlan.from_dict(p) for p in stored]
    grid = np.asarray(rec.get("video_grid_thw", np.zeros((0, 3))), dtype=np.int64).reshape(-1, 3)
    data = rec.get("videos", ())
    if not (len(plans) == len(grid) == len(data)):
        raise ValueError(f"bin {rec['key']}: {len(data)} videos, {len(plans)} plans, {len(grid)} grids")
    if not plans:
        return []
    if check_pads:
        _check_video_pads(rec, ids, plans, cfg)
    out = []
    for i, (blob, plan, g) in enumerate(zip(data, plans, grid)):
        if tuple(int(v) for v in g) != tuple(plan.grid_thw):
            raise ValueError(
                f"bin {rec['key']} video {i}: grid {g.tolist()} differs from its plan's {plan.grid_thw}"
            )
        name = _video_name(stored[i], rec["key"], i)
        load = load_codec_video if plan.run_tokens else load_video  # codec canvases, or a video file
        try:
            out.append(load(blob, plan, cfg.rule, name=name))
        except MemoryError:
            raise
        except Exception as e:  # a damaged file: blank, and its sample dropped by the caller
            if failures is None:
                raise
            failures.append(MediaFailure("video", i, _video_file(stored[i], rec["key"], i), one_line(e)))
            out.append(_blank_video(plan, cfg))
    return out


def _blank_video(plan: VideoPlan, cfg: CollateConfig) -> VideoPixels:
    """Zero patches in the shape of the planned video (a codec video's at its canvases' block positions)."""
    grid = (int(plan.grid_thw[0]), int(plan.grid_thw[1]), int(plan.grid_thw[2]))
    blank = np.zeros((grid[0] * grid[1] * grid[2], cfg.rule.patch_dim), dtype=np.float32)
    positions = block_patch_positions(np.asarray([grid]), cfg.rule.merge_size) if plan.run_tokens else None
    return VideoPixels(blank, grid, plan.second_per_grid_t, positions)


def _video_file(plan: dict, key: str, i: int) -> str:
    """The video as its record named it (datasets packed since plans record it), else its place in the bin."""
    return str(plan.get("source") or f"video {i} of bin {key}")


def _check_video_pads(rec: BinRecord, ids: np.ndarray, plans: list[VideoPlan], cfg: CollateConfig) -> None:
    if cfg.video_pad_id < 0:
        raise ValueError(
            f"bin {rec['key']} holds videos but the manifest's tokenizer has no <|video_pad|> id"
        )
    expected_pads = sum(p.num_tokens for p in plans)
    got_pads = int(np.count_nonzero(ids == cfg.video_pad_id))
    if got_pads != expected_pads:
        raise ValueError(
            f"bin {rec['key']}: {got_pads} <|video_pad|> tokens, its videos need {expected_pads}"
        )


def _video_name(plan: dict, key: str, i: int) -> str:
    """How errors name a video: as its record named it, with its sample (datasets packed since these were
    recorded), and where it is in the shard."""
    where = f"bin {key} video {i}"
    if "source" not in plan:
        return where
    return f"{plan['source']} of sample {plan.get('sample_id')!r} ({where})"
