"""Stage 2, lengths: exact token ids, loss mask and length of every scanned sample.

Reads:  `<work>/scan/chunk-N.samples.jsonl`, the tokenizer (-t), the image-token rule flags, the video rule
        flags (--video-*: each video's frames, size, grid and tokens planned from its container metadata).
Writes: `<work>/lengths/chunk-N.{ids,mask,offsets,nimg}.npy` (token ids and loss mask of the chunk's kept
        samples, concatenated), `chunk-N.samples.jsonl` (ids, images, grids) with its line offsets
        `chunk-N.meta_offsets.npy`, `chunk-N.rejects.jsonl`
        (over-length, bad image sizes, videos the rule refuses), `chunk-N.done.json`, then
        `<work>/lengths.done.json`.
Run alone: `python -m mmpack.offline_packing.lengths <mmpack pack flags>`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmpack.offline_packing.config import LengthsStage
from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines import run_parallel
from mmpack.offline_packing.errors import PackError, SampleReject, VideoProbeError, reject_row
from mmpack.offline_packing.inputs import video_timeline
from mmpack.offline_packing.inputs.remote import RemoteFiles
from mmpack.offline_packing.workdir import WorkDir, jsonl_line, read_done_marker, read_jsonl
from mmpack.packing.chat import (
    Conversation,
    SampleError,
    encode_texts,
    finish_tokenized,
    prepare_conversation,
    truncate_sample,
)
from mmpack.packing.image_tokens import ImageSizeError
from mmpack.packing.jinja_chat import VIDEO_TAG, ChatTemplateError
from mmpack.packing.template_limits import ChatTemplateLimitError
from mmpack.packing.video_tokens import VideoMeta, VideoRuleError

STAGE = "lengths"
ENCODE_BATCH = 256  # samples whose rendered texts are encoded in one tokenizer call
ENCODE_CALL_CHARS = 1 << 22  # ... unless their texts are longer together: a call's memory grows with its text


@dataclass(frozen=True)
class LengthsTask:
    """One scanned chunk to tokenize (picklable)."""

    chunk: int
    cfg: LengthsStage
    fingerprint: str


def plan_videos(sample: dict, vrule: Any, remote: RemoteFiles | None = None) -> list[Any]:
    """The `VideoPlan` of each video of a scanned sample; SampleReject where the rule refuses one (or, given
    `remote` to read them with, where its planned frames do not decode: `--video-check decode`)."""
    plans = []
    for path, info in zip(sample.get("videos", ()), sample.get("video_info", ())):
        try:
            if "codec" in info:  # LLaVA-OneVision-2 codec canvases: planned from the scan's summary
                plans.append(vrule.plan_codec(info["codec"]))
                continue
            plans.append(vrule.plan(VideoMeta(**info["meta"])))
            if remote is not None:
                video_timeline.decode_check(remote, path, plans[-1], name=path)
        except (VideoRuleError, VideoProbeError) as exc:  # a network error past the retries ends the job
            raise SampleReject(exc.reason, f"video {path}: {exc.message}") from None
    return plans


@dataclass(frozen=True)
class ScannedPrep:
    """A scanned sample checked and rendered, waiting for its text to be encoded (`finish_scanned`)."""

    sample: dict
    grids: list[Any]
    plans: list[Any]
    prep: Any  # mmpack.packing.chat.PreparedConversation


def prepare_scanned(
    sample: dict, cfg: LengthsStage, tokenizer: Any, remote: RemoteFiles | None = None
) -> ScannedPrep:
    """Image grids, video plans and the rendered conversation of one scanned sample (SampleReject where a rule
    refuses an image or video, or the chat template renders it in a way the loss mask cannot be read from).
    `remote`: what `--video-check decode` reads videos with (`plan_videos`)."""
    rule, options = cfg.lengths.image_rule, cfg.lengths
    grids = []
    for w, h in sample["wh"]:
        try:
            grids.append(rule.grid_thw(h, w))
        except ImageSizeError as exc:
            raise SampleReject(exc.reason, exc.message) from None
    if cfg.max_images_per_bin is not None and len(grids) > cfg.max_images_per_bin:
        raise SampleReject(
            "too_many_images", f"{len(grids)} images > --max-images-per-bin {cfg.max_images_per_bin}"
        )
    counts = [rule.tokens_of_grid(g) for g in grids]
    plans = plan_videos(sample, options.video_rule, remote if options.video_check == "decode" else None)
    conv = Conversation(
        messages=tuple((r, c) for r, c in sample["messages"]),
        images=tuple(sample["images"]),
        sample_id=sample["id"],
        videos=tuple(sample.get("videos", ())),
    )
    # a video's one pad (or whole block) becomes what its rule's style writes (Qwen3-VL's timestamps and
    # frames, ...), else its pads repeated; a tokenizer without a video pad is refused by prepare_conversation
    style = options.video_rule.kind
    expanded = bool(plans) and "video_pad" in tokenizer.special_ids
    expansions = [style.token_ids(tokenizer, p) for p in plans] if expanded else []
    expansions = expansions if any(e is not None for e in expansions) else []
    whole = bool(expansions) and style.whole_block
    if expanded and grids and not style.with_images:  # its processor gives other ids and pixels than the text
        raise SampleReject("video_with_images", f"{len(grids)} images and {len(plans)} videos")
    if len(plans) > 1 and any(p.run_tokens for p in plans):  # the codec rewrite takes one video's blocks
        raise SampleReject(
            "codec_video",
            f"{len(plans)} videos, one of them codec canvases: a codec video must be its sample's only one",
        )
    # an image's placeholder becomes what its rule's style writes (Gemma 4's <|image> N x <|image|> <image|>),
    # else its pad repeated
    image_ids = [rule.kind.token_ids(tokenizer, n) for n in counts]
    image_ids = image_ids if any(e is not None for e in image_ids) else []
    try:
        prep = prepare_conversation(
            conv, tokenizer, counts, options.chat_template, [p.num_tokens for p in plans], expansions, whole,
            image_ids,
        )  # fmt: skip
    except ChatTemplateLimitError as exc:  # the template went past a limit: the job stops, naming the sample
        raise PackError(f"{sample['src']}:{sample['line']}: {exc}") from None
    except ChatTemplateError as exc:
        raise SampleReject("chat_template_mismatch", str(exc)) from None
    except SampleError as exc:  # a control token of the rules' tokenizer in the text
        raise SampleReject(exc.reason, exc.message) from None
    except ValueError as exc:
        if plans and "video_pad" not in tokenizer.special_ids:
            raise PackError(f"{sample['src']}:{sample['line']}: {exc}") from None
        raise
    _check_text_fits(prep.text, cfg, tokenizer, sample)
    if whole:
        _check_video_starts(prep, plans, tokenizer, style)
    return ScannedPrep(sample, grids, plans, prep)


def text_char_limit(seq_len: int, tokenizer: Any) -> int | None:
    """The most characters of rendered text the stage hands the tokenizer: a longer text holds more than `seq_len`
    tokens whatever it says (`max_token_chars`, the most characters one token stands for); None where the
    tokenizer gives no such bound."""
    per_token = getattr(tokenizer, "max_token_chars", None)
    return None if per_token is None else seq_len * per_token


def _check_text_fits(text: str, cfg: LengthsStage, tokenizer: Any, sample: dict) -> None:
    """A text past `text_char_limit` is over-length before it is tokenized (a tokenizer takes about 125 bytes of
    memory per character): a reject (`drop`, and `truncate`, which could not know its cut exactly without
    tokenizing it whole), or the job's error (`error`)."""
    limit = text_char_limit(cfg.seq_len, tokenizer)
    if limit is None or len(text) <= limit:
        return
    message = (
        f"text of {len(text)} characters holds more than seq_len {cfg.seq_len} tokens (one token stands for at "
        f"most {limit // cfg.seq_len} characters); not tokenized: split the record"
    )
    if cfg.lengths.overlength == "error":
        raise PackError(f"{sample['src']}:{sample['line']}: overlength: {message} (--overlength error)")
    raise SampleReject("overlength", message)


def _check_video_starts(prep: Any, plans: list[Any], tokenizer: Any, style: Any) -> None:
    """SampleReject where the text a video's whole block starts with (`VideoStyle.leading_text`, OV-2's first
    timestamp), encoded alone, is not how the processor's text encodes it after the text before the video (the
    two would merge)."""
    spans = [(a, b) for tag, a, b in prep.rendered.media_char_spans if tag == VIDEO_TAG]
    for (a, b), plan in zip(spans, plans):
        tail = style.trailing_text(plan)
        if tail and not prep.text.startswith(tail, b):
            raise SampleReject(
                "codec_video",
                f"the text after a codec <video> does not start with {tail!r} (the processor's rewrite takes it); "
                "put a newline right after the <video> tag",
            )
        before, head = prep.text[:a], style.leading_text(plan)
        if head and tokenizer.encode(before + head) != tokenizer.encode(before) + tokenizer.encode(head):
            raise SampleReject(
                "video_timestamp_merge",
                f"the text {before[-12:]!r} right before a <video> merges with its first timestamp {head!r} in "
                "the tokenizer; put a newline or a letter before the <video> tag",
            )


def finish_scanned(pending: ScannedPrep, cfg: LengthsStage, tok: Any) -> tuple[Any, dict]:
    """A prepared sample's tokens (`TokenizedSample` of its text) under the over-length policy, and its
    metadata row."""
    sample, grids, plans = pending.sample, pending.grids, pending.plans
    full_len = len(tok)
    if full_len > cfg.seq_len:
        message = f"{len(tok)} tokens > seq_len {cfg.seq_len}"
        if cfg.lengths.overlength == "error":
            raise PackError(f"{sample['src']}:{sample['line']}: overlength: {message} (--overlength error)")
        if cfg.lengths.overlength == "drop":
            raise SampleReject("overlength", message)
        cut = truncate_sample(tok, cfg.seq_len)
        if cut is None:
            raise SampleReject("overlength", f"{message}; no cut outside an image keeps a target token")
        tok = cut
    n = tok.num_images
    meta = {
        "src": sample["src"],
        "line": sample["line"],
        "id": sample["id"],
        "images": sample["images"][:n],
        "fmt": sample["fmt"][:n],
        "nbytes": sample["nbytes"][:n],
        "grid": [list(g) for g in grids[:n]],
        "image_tokens": int(tok.num_image_tokens),
        "truncated_from": full_len if full_len != len(tok) else None,
    }
    if plans:  # image-only samples keep their earlier row
        k = tok.num_videos
        info = sample["video_info"][:k]
        meta |= {
            "videos": sample["videos"][:k],
            "vfmt": [v["fmt"] for v in info],
            "vbytes": [v["nbytes"] for v in info],
            # with the video as the record names it and its sample: what a loader error reports
            "video_plans": [
                {**p.to_dict(), "source": name, "sample_id": sample["id"]}
                for p, name in zip(plans[:k], sample.get("video_names", sample["videos"]))
            ],
            "video_tokens": int(tok.num_video_tokens),
        }
        if any("files" in v for v in info):  # a codec video in the training form: its files, for the writer
            meta["codec_files"] = [v.get("files") for v in info]
    return tok, meta


def tokenize_scanned(
    sample: dict, cfg: LengthsStage, tokenizer: Any, remote: RemoteFiles | None = None
) -> tuple[Any, dict]:
    """Token ids + loss mask of one scanned sample under the over-length policy, and its metadata row."""
    pending = prepare_scanned(sample, cfg, tokenizer, remote)
    [tok] = finish_tokenized([pending.prep], tokenizer, encode_texts(tokenizer, [pending.prep.text]))
    return finish_scanned(pending, cfg, tok)


def tokenize_chunk_samples(
    samples: Iterable[dict], cfg: LengthsStage, tokenizer: Any, remote: RemoteFiles | None = None
) -> Iterator[tuple[dict, Any]]:
    """(sample, (tok, meta) or its SampleReject) per scanned sample, in order, as `tokenize_scanned` gives them,
    with the texts of each `ENCODE_BATCH` samples (fewer where their texts pass `ENCODE_CALL_CHARS` together)
    encoded in one tokenizer call. Other errors are raised at the sample that causes them, after the samples
    before it."""
    it = iter(samples)
    ended = False
    while not ended:
        batch: list[dict] = []
        prepared: list[ScannedPrep | Exception] = []
        read_error: Exception | None = None
        try:  # an error reading sample k comes after the results of the samples before it
            ended = _prepare_batch(it, batch, prepared, cfg, tokenizer, remote)
        except Exception as exc:
            read_error, ended = exc, True
        preps = [p.prep for p in prepared if isinstance(p, ScannedPrep)]
        finished = finish_tokenized(preps, tokenizer, encode_texts(tokenizer, [p.text for p in preps]))
        for sample, p in zip(batch, prepared):
            if isinstance(p, SampleReject):
                yield sample, p
                continue
            if isinstance(p, Exception):
                raise p
            tok = next(finished)
            try:
                yield sample, finish_scanned(p, cfg, tok)
            except SampleReject as exc:
                yield sample, exc
        if read_error is not None:
            raise read_error


def _prepare_batch(
    it: Iterator[dict], batch: list[dict], prepared: list[ScannedPrep | Exception], cfg: LengthsStage, tokenizer: Any,
    remote: RemoteFiles | None,
) -> bool:  # fmt: skip
    """Reads and prepares samples of `it` into `batch` / `prepared` (a `ScannedPrep` or the error) until
    `ENCODE_BATCH` samples or `ENCODE_CALL_CHARS` characters of text; True once `it` is exhausted."""
    chars = 0
    for sample in it:
        batch.append(sample)
        try:
            ready = prepare_scanned(sample, cfg, tokenizer, remote)
            prepared.append(ready)
            chars += len(ready.prep.text)
        except Exception as exc:  # raised in order by the caller
            prepared.append(exc)
        if len(batch) >= ENCODE_BATCH or chars >= ENCODE_CALL_CHARS:
            return False
    return True


def lengths_chunk(ctx: JobContext, task: LengthsTask) -> dict:
    """Tokenize one scanned chunk and write its arrays; returns its counts. Pure function of the task."""
    wd = ctx.work
    done = wd.chunk_path(STAGE, task.chunk, "done.json")
    if (marker := read_done_marker(done, task.fingerprint)) is not None:
        return marker
    cfg = task.cfg
    tokenizer = ctx.tokenizer(cfg.tokenizer, cfg.lengths.control_tokens)
    ids, masks, metas, rejects = [], [], [], []
    scanned = read_jsonl(wd.chunk_path("scan", task.chunk, "samples.jsonl"))
    for sample, result in tokenize_chunk_samples(scanned, cfg, tokenizer, ctx.remote):
        if isinstance(result, SampleReject):
            exc = result
            if cfg.strict:
                raise PackError(f"{sample['src']}:{sample['line']}: {exc.reason}: {exc.message}") from None
            rejects.append(
                reject_row(sample["src"], sample["line"], exc.reason, exc.message, STAGE, sample["id"])
            )
            continue
        tok, meta = result
        ids.append(tok.input_ids)
        masks.append(tok.loss_mask)
        metas.append(meta)
    offsets = np.zeros(len(ids) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(x) for x in ids], dtype=np.int64)
    path = lambda suffix: wd.chunk_path(STAGE, task.chunk, suffix)  # noqa: E731
    wd.write_npy(path("ids.npy"), np.concatenate(ids) if ids else np.zeros(0, np.uint32))
    wd.write_npy(path("mask.npy"), np.concatenate(masks) if masks else np.zeros(0, np.uint8))
    wd.write_npy(path("offsets.npy"), offsets)
    wd.write_npy(path("nimg.npy"), np.array([len(m["images"]) for m in metas], dtype=np.int64))
    media_bytes = [sum(m["nbytes"]) + sum(m.get("vbytes", ())) for m in metas]
    wd.write_npy(path("ibytes.npy"), np.array(media_bytes, dtype=np.int64))
    lines = [jsonl_line(m) for m in metas]
    line_offsets = np.zeros(len(lines) + 1, dtype=np.int64)
    line_offsets[1:] = np.cumsum([len(x) for x in lines], dtype=np.int64)
    wd.write_bytes(path("samples.jsonl"), b"".join(lines))
    wd.write_npy(path("meta_offsets.npy"), line_offsets)  # random access for the write stage
    wd.write_jsonl(path("rejects.jsonl"), rejects)
    counts = {
        "fingerprint": task.fingerprint,
        "accepted": len(metas),
        "rejected": len(rejects),
        "image_tokens": sum(m["image_tokens"] for m in metas),
        "video_tokens": sum(m.get("video_tokens", 0) for m in metas),
        "videos": sum(len(m.get("videos", ())) for m in metas),
        "truncated": sum(m["truncated_from"] is not None for m in metas),
    }
    wd.write_json(done, counts)
    return counts


def load_lengths(wd: WorkDir, n_chunks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths, image counts and image bytes of every kept sample, in global order (chunk, then position)."""
    lengths = [np.diff(np.load(wd.chunk_path(STAGE, c, "offsets.npy"))) for c in range(n_chunks)]
    nimg = [np.load(wd.chunk_path(STAGE, c, "nimg.npy")) for c in range(n_chunks)]
    ibytes = [np.load(wd.chunk_path(STAGE, c, "ibytes.npy")) for c in range(n_chunks)]
    cat = lambda xs: np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, np.int64)  # noqa: E731
    return cat(lengths), cat(nimg), cat(ibytes)


def run_lengths(
    ctx: JobContext, cfg: LengthsStage, fingerprint: str, *, workers: int, progress: bool
) -> dict:
    """Stage 2 over all scanned chunks; returns the marker info."""
    wd = ctx.work
    scan_info = wd.read_marker("scan")
    n_chunks = len(scan_info["chunks"])
    tasks = [LengthsTask(c, cfg, fingerprint) for c in range(n_chunks)]
    # loaded once here; forked workers inherit it instead of each parsing it
    ctx.tokenizer(cfg.tokenizer, cfg.lengths.control_tokens)
    results = run_parallel(
        ctx,
        lengths_chunk,
        tasks,
        workers=workers,
        weights=scan_info["accepted"],
        desc="lengths",
        progress=progress,
    )
    info = {
        "accepted": [r["accepted"] for r in results],
        "rejected": sum(r["rejected"] for r in results),
        "image_tokens": [r["image_tokens"] for r in results],
        "video_tokens": [r.get("video_tokens", 0) for r in results],
        "videos": sum(r.get("videos", 0) for r in results),
        "truncated": sum(r.get("truncated", 0) for r in results),
    }
    wd.mark_done(STAGE, fingerprint, info)
    return info


if __name__ == "__main__":
    from mmpack.offline_packing.pipeline import stage_main

    raise SystemExit(stage_main(STAGE))
