"""Errors of the packing job, the rows of rejects.jsonl, and the one line a failed `mmpack` command prints.

Every error mmpack raises on purpose is a `mmpack.packing.errors.MmpackError` with a `reason`; per-sample ones become
reject rows, job-level ones end the command with `mmpack <cmd>: error: ...` (see `describe_failure`).
"""

from __future__ import annotations

import errno
import os
import re

from mmpack.packing.errors import MmpackError

_TEMPORARY = re.compile(r"^\.(?P<name>.+)\.tmp-[0-9-]+$")  # atomic writes go through ".<name>.tmp-<pid>..."


class PackError(MmpackError, RuntimeError):
    """The job cannot go on (bad option, `--strict` reject, `--overlength error`); the message says why."""

    default_reason = "job_error"


# Every reason a sample can be rejected for (rejects.jsonl "reason", the manifest's rejected_by_reason), the one
# list of them: each per-sample error reaches rejects.jsonl as a SampleReject, which accepts only these.
REJECT_REASONS: dict[str, str] = {
    # the record
    "malformed_json": "not valid JSON, or not UTF-8",
    "malformed_record": "valid JSON that is no usable record: not an object, nested deeper than 100 levels, "
    "fields of the wrong type, both `image` and `images`, strings that are not valid Unicode (lone surrogates)",
    "record_too_large": "its JSON text is longer than --max-record-bytes (found before it is parsed or tokenized)",
    "unknown_role": "a message role other than system, user/human, assistant/gpt",
    "empty_conversation": "no messages",
    "misplaced_system": "a system message after the first position",
    "no_assistant_turn": "no assistant message with content: nothing to train on",
    "image_tag_mismatch": "the number of <image> tags differs from the number of images",
    "video_tag_mismatch": "the number of <video> tags differs from the number of videos",
    "reserved_token_in_text": "a message holds a control token of the chat template as text",
    "unsupported_modality": "audio (a field or an <audio> tag): not counted yet, never packed as text",
    # images
    "missing_image": "the image file (or tar member) does not exist",
    "image_not_a_file": "the image path is a FIFO, socket, device or folder, never opened",
    "unreadable_image": "not an image Pillow reads, truncated or corrupt",
    "image_path_escape": "an absolute path or one leaving the image root (`..`, also percent-encoded, symlinks)",
    "image_too_large": "more pixels than --max-image-pixels (from the header)",
    "image_aspect_ratio": "longer side over 200 times the shorter",
    "image_size_invalid": "an image size without pixels (0 wide or high)",
    "too_many_images": "more images than --max-images-per-bin",
    # videos
    "missing_video": "the video file (or tar member) does not exist",
    "video_not_a_file": "the video path is a FIFO, socket, device or folder, never opened",
    "unreadable_video": "the video cannot be read",
    "empty_video": "an empty file, or a stream without frames",
    "not_a_video": "not a video container FFmpeg reads (an image, text)",
    "corrupt_video": "a video container that does not open, or is truncated",
    "video_path_escape": "an absolute path or one leaving the image root",
    "video_too_long": "longer than --max-video-seconds",
    "video_too_large": "frames with more pixels than --max-image-pixels",
    "video_timestamps": "timestamps too coarse to tell the frames apart (a timescale of 1)",
    "video_too_short": "fewer than 2 frames to sample",
    "video_aspect_ratio": "longer side over 200 times the shorter",
    "video_too_small": "too elongated for the pixel budget: a side would shrink below one merged patch",
    "undecodable_video": "--video-check decode: the planned frames do not decode",
    "video_with_images": "llava_onevision2 rule: a sample with images and videos (its processor mixes them up)",
    "video_timestamp_merge": "llava_onevision2 rule: the text before a <video> merges with its first timestamp",
    "codec_video": "llava_onevision2 codec canvases (a cv-preinfer folder) that do not fit: positions not matching "
    "the canvases, a canvas partly padding, no fps, blocks other than 2 x 2, another video rule, another video in the "
    "sample, or no newline after its <video>",
    # length
    "overlength": "longer than -L under --overlength drop (or no cut keeps a target token under truncate, or a "
    "text too long for -L tokens, never tokenized)",
}


class SampleReject(MmpackError):
    """A per-sample problem: the sample goes to rejects.jsonl with `reason`, one of `REJECT_REASONS`."""

    def __init__(self, reason: str, message: str):
        assert reason in REJECT_REASONS, f"reject reason {reason!r} is not in REJECT_REASONS"
        super().__init__(message, reason=reason)


class VideoProbeError(MmpackError, ValueError):
    """A video the scan rejects; `reason` is a video reason of `REJECT_REASONS` and `message` says what to do."""

    def __init__(self, reason: str, message: str):
        assert reason in REJECT_REASONS, reason
        super().__init__(message, reason=reason)


def reject_row(
    source: str, line: int, reason: str, message: str, stage: str, sample_id: str | None = None
) -> dict:
    """One line of rejects.jsonl."""
    row: dict = {"source": source, "line": line, "reason": reason, "message": message, "stage": stage}
    if sample_id is not None:
        row["sample_id"] = sample_id
    return row


_OS_ADVICE = {
    errno.ENOSPC: "no space left on the device; free space or choose another output (-o) / --work-dir",
    errno.EDQUOT: "disk quota exceeded; free space or choose another output (-o) / --work-dir",
    errno.EACCES: "permission denied; choose a folder you can write to (-o, --work-dir) or fix its permissions",
    errno.EPERM: "operation not permitted; choose a folder you can write to (-o, --work-dir)",
    errno.EROFS: "read-only file system; choose a writable output (-o) / --work-dir",
    errno.ENOENT: "no such file or folder; check the path",
    errno.EISDIR: "is a folder, a file was expected; check the path",
    errno.ENOTDIR: "a part of the path is not a folder; check the path",
}


def describe_failure(exc: BaseException) -> str:
    """The text after `mmpack <cmd>: error: ` for `exc`: what failed, on which file, and what to do."""
    if isinstance(exc, MmpackError):
        return exc.message
    if isinstance(exc, OSError):
        where = _final_name(str(exc.filename)) if exc.filename is not None else None
        advice = _OS_ADVICE.get(exc.errno or 0, exc.strerror or str(exc))
        if where is None:
            return f"{advice} ({exc})" if exc.errno in _OS_ADVICE else str(exc)
        return f"{where}: {advice}"
    if isinstance(exc, ValueError):
        return str(exc)
    return f"unexpected {type(exc).__name__}: {exc} (rerun with --debug for the traceback, and report it)"


def _final_name(path: str) -> str:
    """The file a temporary name stands for (what the user knows), else `path`."""
    head, tail = os.path.split(path)
    match = _TEMPORARY.match(tail)
    return os.path.join(head, match["name"]) if match else path
