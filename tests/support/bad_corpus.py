"""A corpus with one input (or more) for every reject reason of `REJECT_REASONS`, plus good samples, for a test of
the whole job (no pytest dependency).

`make_bad_corpus(root)` writes the media, a JSONL, a WebDataset tar, a JSON array and a gzip JSONL, and returns
the job options that make each reason reachable (small limits, the video rule tightened, `--video-check decode`)
and the expected reject of every bad record as (file name, line) -> reason.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import socket
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from tests.support.fixtures_data import random_words, write_image
from tests.support.video_fixtures import encode_video, stream_copy_cut, timescale_one

# Reasons no input file can produce, and why: the header of every image Pillow opens has pixels.
UNREACHABLE = {
    "image_size_invalid": "Pillow refuses an image header without pixels before mmpack sees a size",
    # reasons of the llava_onevision2 video rule only (this corpus packs with another): there they are tested
    # by tests/test_llava_onevision2_video.py
    "video_with_images": "the llava_onevision2 video rule only",
    "video_timestamp_merge": "the llava_onevision2 video rule only",
    "codec_video": "LLaVA-OneVision-2 codec canvases only: tested by tests/test_ov2_codec_video.py",
}
# A read error a test cannot cause for root (permissions do not stop it): checked only when not root.
ROOT_CANNOT_TEST = {"unreadable_video": "a file root cannot read (chmod 000 stops other users only)"}


@dataclass(frozen=True)
class BadCorpus:
    inputs: tuple[Path, ...]
    media: Path
    options: dict[str, Any]  # PackJobConfig fields besides inputs, output and tokenizer
    expected: dict[tuple[str, int], str]  # (input file name, line) -> reject reason
    n_good: int


def _turns(tag: str = "<image>", text: str = "What is shown?") -> list[dict]:
    return [{"from": "human", "value": f"{tag}{text}"}, {"from": "gpt", "value": "Something."}]


def _media(media: Path, rng: random.Random) -> None:
    write_image(media / "ok.jpg", 60, 40, rng)
    write_image(media / "ok2.png", 50, 50, rng, "PNG")
    (media / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg" * 4)
    (media.parent / "secret.jpg").write_bytes((media / "ok.jpg").read_bytes())
    Image.new("RGB", (1200, 1000), (3, 4, 5)).save(media / "huge.png")  # 1.2 MP > the corpus's 1 MP limit
    Image.new("RGB", (6000, 28), (1, 2, 3)).save(media / "thin.png")  # aspect ratio 214
    os.mkfifo(media / "pipe.jpg")
    os.mkfifo(media / "pipe.mp4")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(media / "sock.jpg"))
    encode_video(media / "ok.mp4", 4)
    stream_copy_cut(
        encode_video(media / "uncut.mp4", 10, gop=5), media / "cut.mp4", 2
    )  # an edit list: honoured
    whole = encode_video(media / "thirty.mp4", 30).read_bytes()
    (media / "truncated.mp4").write_bytes(whole[: len(whole) // 2])
    (media / "empty.mp4").write_bytes(b"")
    (media / "text.mp4").write_text("this is not a video\n" * 20)
    (media.parent / "outside.mp4").write_bytes(whole)
    encode_video(media / "long.mp4", 60)  # 2.4 s > the corpus's 1.8 s
    encode_video(media / "big.mp4", 4, width=1280, height=800)  # 1.02 MP frames
    timescale_one(encode_video(media / "source.mp4", 50, gop=25), media / "ts1.mp4")
    encode_video(media / "one.mp4", 1)
    encode_video(media / "wide.mp4", 4, width=5800, height=28)
    encode_video(media / "many.mp4", 40)  # 40 sampled frames leave each too few pixels: too small
    eight = bytearray(encode_video(media / "eight.mp4", 8).read_bytes())
    eight[len(eight) // 3 : len(eight) // 3 + 300] = bytes(
        300
    )  # zeroed frame bytes: only a decode finds them
    (media / "zeroed.mp4").write_bytes(bytes(eight))
    if os.geteuid() != 0:
        (media / "locked.mp4").write_bytes(whole)
        (media / "locked.mp4").chmod(0)


def _jsonl_records(rng: random.Random) -> list[tuple[Any, str | None]]:
    """(record or raw line, expected reason or None for a good one)."""
    image = lambda name, **kw: {"image": name, "conversations": _turns(), **kw}  # noqa: E731
    video = lambda name: {"video": name, "conversations": _turns("<video>", "What moves?")}  # noqa: E731
    rows: list[tuple[Any, str | None]] = [
        (image("ok.jpg"), None),
        ('{"conversations": [{"from": "human", "value": "hi"}', "malformed_json"),
        ([1, 2, 3], "malformed_record"),
        ('{"id": "x\\ud800", "conversations": ' + json.dumps(_turns("", "hi")) + "}", "malformed_record"),
        ({"conversations": _turns("", "x" * 70_000)}, "record_too_large"),
        (
            {"conversations": [{"from": "robot", "value": "beep"}, {"from": "gpt", "value": "ok"}]},
            "unknown_role",
        ),
        ({"conversations": []}, "empty_conversation"),
        (
            {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]},
            "misplaced_system",
        ),
        ({"messages": [{"role": "user", "content": "only a question"}]}, "no_assistant_turn"),
        ({"image": "ok.jpg", "conversations": _turns("", "no tag")}, "image_tag_mismatch"),
        ({"video": "ok.mp4", "conversations": _turns("", "no tag")}, "video_tag_mismatch"),
        ({"conversations": _turns("", "say <|im_start|> now")}, "reserved_token_in_text"),
        ({"audio": "a.wav", "conversations": _turns("", "listen")}, "unsupported_modality"),
        ({"conversations": _turns("", random_words(rng, 3000))}, "overlength"),
        (image("nope.jpg"), "missing_image"),
        (image("pipe.jpg"), "image_not_a_file"),
        (image("sock.jpg"), "image_not_a_file"),
        (image("corrupt.jpg"), "unreadable_image"),
        (image("../secret.jpg"), "image_path_escape"),
        (image("huge.png"), "image_too_large"),
        (image("thin.png"), "image_aspect_ratio"),
        (
            {"images": ["ok.jpg"] * 4, "conversations": _turns("<image>" * 4, "Four times.")},
            "too_many_images",
        ),
        (image("ok2.png"), None),
        (video("ok.mp4"), None),
        (video("cut.mp4"), None),
        (video("absent.mp4"), "missing_video"),
        (video("pipe.mp4"), "video_not_a_file"),
        (video("empty.mp4"), "empty_video"),
        (video("text.mp4"), "not_a_video"),
        (video("truncated.mp4"), "corrupt_video"),
        (video("../outside.mp4"), "video_path_escape"),
        (video("long.mp4"), "video_too_long"),
        (video("big.mp4"), "video_too_large"),
        (video("ts1.mp4"), "video_timestamps"),
        (video("one.mp4"), "video_too_short"),
        (video("wide.mp4"), "video_aspect_ratio"),
        (video("many.mp4"), "video_too_small"),
        (video("zeroed.mp4"), "undecodable_video"),
        ({"conversations": _turns("", "a good text-only record")}, None),
    ]
    if os.geteuid() != 0:
        rows.append((video("locked.mp4"), "unreadable_video"))
    return rows


def _tar(path: Path, media: Path) -> dict[int, str | None]:
    """Sample 1 good, 2 with a .json over the size limit, 3 naming a FIFO member (never read: missing)."""
    members: list[tuple[str, bytes | None]] = [
        ("s1.json", json.dumps({"image": "jpg", "conversations": _turns()}).encode()),
        ("s1.jpg", (media / "ok.jpg").read_bytes()),
        ("s2.json", json.dumps({"conversations": _turns("", "y" * 70_000)}).encode()),
        ("s3.json", json.dumps({"image": "fifo.jpg", "conversations": _turns()}).encode()),
        ("s3.fifo.jpg", None),
    ]
    with tarfile.open(path, "w") as tar:
        for name, body in members:
            info = tarfile.TarInfo(name)
            if body is None:
                info.type = tarfile.FIFOTYPE
            else:
                info.size = len(body)
            tar.addfile(info, io.BytesIO(body or b""))
    return {1: None, 2: "record_too_large", 3: "missing_image"}


def make_bad_corpus(root: Path, seed: int = 0) -> BadCorpus:
    """Write the corpus under `root` (see the module docstring)."""
    rng = random.Random(seed)
    media = root / "media"
    media.mkdir(parents=True)
    _media(media, rng)
    expected: dict[tuple[str, int], str] = {}
    n_good = 0
    rows = _jsonl_records(rng)
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r, _ in rows))
    for line, (_, reason) in enumerate(rows, start=1):
        if reason is None:
            n_good += 1
        else:
            expected[("corpus.jsonl", line)] = reason
    for line, reason in _tar(root / "shard.tar", media).items():
        n_good += reason is None
        if reason is not None:
            expected[("shard.tar", line)] = reason
    good = {"conversations": _turns("", "fine")}
    array = root / "array.json"  # a JSON array, one element per line
    array.write_text(f"[\n{json.dumps(good)},\n{json.dumps({'conversations': []})}\n]\n")
    expected[("array.json", 3)] = "empty_conversation"
    gz = root / "more.jsonl.gz"
    gz.write_bytes(gzip.compress((json.dumps(good) + "\n{broken\n").encode()))
    expected[("more.jsonl.gz", 2)] = "malformed_json"
    n_good += 2
    options = dict(
        image_root=str(media),
        seq_len=512,
        max_record_bytes=65536,
        max_image_pixels=1_000_000,
        max_images_per_bin=3,
        max_video_seconds=1.8,
        video_fps=25.0,  # every frame sampled: a video's frame count sets its pixel budget
        video_min_pixels=784,
        video_total_pixels=8000.0,
        video_check="decode",
        chunk_size=8,
        workers=2,
        format="both",
    )
    return BadCorpus((jsonl, root / "shard.tar", array, gz), media, options, expected, n_good)
