"""Tiny synthetic videos for the demo: a few short clips (PyAV, H.264 in mp4 or MPEG-4 in avi) and records that
ask about them, appended to a synthetic dataset (`mmpack.demo.synthetic`).

The clips are small (64..160 pixels a side, 9..40 frames) so that packing, decoding and training stay quick;
frame counts are odd or even and one record mixes an image with two videos. Deterministic in `seed`.
"""

from __future__ import annotations

import json
import random
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from mmpack.demo.synthetic import SyntheticData, random_words

_QUESTIONS = ("What happens in this clip?", "Describe the motion.", "Which way does the bar move?")


def write_video(path: Path, n_frames: int, width: int, height: int, rate: int, seed: int) -> Path:
    """Encode a clip of a colour field with a bar sweeping across it; mp4 (H.264) or avi (MPEG-4) by suffix."""
    import av

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, 3)
    y, x = np.mgrid[0:height, 0:width]
    codec = "mpeg4" if path.suffix == ".avi" else "libx264"
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream: Any = out.add_stream(codec, rate=Fraction(rate))
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(n_frames):
            rgb = np.empty((height, width, 3), np.uint8)
            rgb[...] = (base + 3 * i) % 256
            rgb[..., 1] = (rgb[..., 1] + y * 128 // height) % 256
            rgb[np.abs(x - (i * 7) % width) < 3] = 255
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def add_synthetic_videos(data: SyntheticData, n_videos: int, seed: int = 0) -> SyntheticData:
    """Write `n_videos` clips under `data.image_root/videos` and append one record per clip (LLaVA `video`
    or ShareGPT `videos`) to the dataset's JSONL, plus one record mixing an image with two clips."""
    if n_videos < 1:
        return data
    rng = random.Random(seed)
    root = data.image_root
    rel: list[str] = []
    for i in range(n_videos):
        suffix = ".avi" if i % 3 == 2 else ".mp4"
        w, h = rng.randrange(64, 161, 2), rng.randrange(48, 121, 2)
        path = write_video(
            root / "videos" / f"clip_{i:04d}{suffix}",
            rng.randint(9, 40),
            w,
            h,
            rng.choice((10, 25)),
            seed + i,
        )
        rel.append(path.relative_to(root).as_posix())
    records = []
    for i, video in enumerate(rel):
        question, answer = rng.choice(_QUESTIONS), random_words(rng, rng.randint(4, 20))
        if i % 2:
            turns = [
                {"role": "user", "content": f"<video>{question}"},
                {"role": "assistant", "content": answer},
            ]
            records.append({"id": f"video-{i}", "messages": turns, "videos": [video]})
        else:
            conv = [{"from": "human", "value": f"<video>\n{question}"}, {"from": "gpt", "value": answer}]
            records.append({"id": f"video-{i}", "conversations": conv, "video": video})
    if data.image_paths:
        image = data.image_paths[0].relative_to(root).as_posix()
        content = "<video>First clip.<image>A picture.<video>Second clip: compare all three."
        turns = [{"role": "user", "content": content}, {"role": "assistant", "content": random_words(rng, 8)}]
        records.append(
            {"id": "video-mixed", "messages": turns, "images": [image], "videos": [rel[0], rel[-1]]}
        )
    with open(data.jsonl_path, "a", encoding="utf-8") as f:
        f.write("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records))
    return replace(
        data,
        n_samples=data.n_samples + len(records),
        records=(*data.records, *records),
        counts_by_format={**data.counts_by_format, "video": len(records)},
        video_paths=tuple(root / r for r in rel),
    )
