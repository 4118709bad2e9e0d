"""Test fixtures over `mmpack.demo.synthetic`: bad-input datasets and plain readers of packed shards.

Re-exports the synthetic generator (`make_synthetic_dataset`, `train_tiny_bpe`, `write_image`, ...) so tests
and benchmarks import everything from here; `make_bad_dataset` writes one record per kind of bad input with
the expected reject reason; `read_arrow_bins` / `read_wds_bins` read shards with plain pyarrow / webdataset.
No pytest dependency.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from mmpack.demo.synthetic import (
    RECORD_FORMATS,
    SPECIAL_TOKENS,
    SyntheticData,
    main,
    make_synthetic_dataset,
    random_words,
    train_tiny_bpe,
    write_image,
)

__all__ = [
    "RECORD_FORMATS",
    "SPECIAL_TOKENS",
    "BadCase",
    "BadData",
    "SyntheticData",
    "dataset_files",
    "make_bad_dataset",
    "make_synthetic_dataset",
    "read_arrow_bins",
    "read_wds_bins",
    "train_tiny_bpe",
    "write_image",
]


@dataclass(frozen=True)
class BadCase:
    """One bad input record: its 1-based line in the JSONL and the reject reason expected for it."""

    line: int
    reason: str
    description: str


@dataclass(frozen=True)
class BadData:
    """What `make_bad_dataset` wrote: good records interleaved with one record per kind of bad input."""

    jsonl_path: Path
    image_root: Path
    n_lines: int
    n_good: int
    bad: tuple[BadCase, ...]
    odd_good: tuple[str, ...]  # descriptions of unusual-but-valid records (PNG named .jpg, RGBA, ...)


def make_bad_dataset(root: Path, seed: int = 0) -> BadData:
    """Write a JSONL mixing good records with every kind of bad input the packer must reject.

    `truncated.jpg` keeps its header, so only a decode (not a header read) finds it.
    Reasons: malformed_json, malformed_record, empty_conversation, image_tag_mismatch, missing_image,
    unreadable_image (truncated or corrupt image file), image_path_escape (absolute or ../ paths),
    image_aspect_ratio. A 10x10 image is valid (upscaled to 56x56, as transformers does).
    Over-length samples are not included (they depend on seq_len; see tests).
    """
    rng = random.Random(seed)
    root = Path(root)
    img_dir = root / "imgs"
    good_jpg = write_image(img_dir / "good.jpg", 120, 90, rng)
    write_image(img_dir / "png_named.jpg", 64, 80, rng, "PNG")
    write_image(img_dir / "real.webp", 70, 50, rng, "WEBP")
    Image.new("RGBA", (60, 60), (10, 200, 30, 128)).save(img_dir / "rgba.png")
    Image.new("L", (90, 40), 77).save(img_dir / "gray.jpg", format="JPEG")
    big_jpg = write_image(img_dir / "big.jpg", 400, 300, rng)
    # header intact (size readable), entropy-coded data cut: only a decode finds it
    (img_dir / "truncated.jpg").write_bytes(big_jpg.read_bytes()[: big_jpg.stat().st_size * 3 // 5])
    (img_dir / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a jpeg" * 4)
    (root / "secret.jpg").write_bytes(good_jpg.read_bytes())  # exists, but outside the image root
    Image.new("RGB", (10, 10), (1, 2, 3)).save(img_dir / "tiny.png")  # below one 28x28 merged patch: upscaled
    Image.new("RGB", (6000, 28), (1, 2, 3)).save(img_dir / "thin.png")  # aspect ratio 214 > 200

    def llava(img: str | None, q: str = "<image>\nWhat is this?", a: str = "A test picture.") -> str:
        rec: dict = {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
        if img is not None:
            rec["image"] = img
        return json.dumps(rec)

    lines: list[str] = []
    bad: list[BadCase] = []
    odd: list[str] = []

    def add_good(text: str, what: str | None = None) -> None:
        lines.append(text)
        if what:
            odd.append(what)

    def add_bad(text: str, reason: str, what: str) -> None:
        lines.append(text)
        bad.append(BadCase(len(lines), reason, what))

    add_good(llava("good.jpg"))
    add_bad('{"conversations": [{"from": "human", "value": "hi"}', "malformed_json", "truncated JSON line")
    add_good(llava("png_named.jpg"), "PNG named .jpg")
    add_bad(llava("nope.jpg"), "missing_image", "image file does not exist")
    add_good(llava("real.webp"), "WEBP image")
    add_bad(llava("truncated.jpg"), "unreadable_image", "truncated JPEG")
    add_good(llava("rgba.png"), "RGBA PNG")
    add_bad(llava("corrupt.jpg"), "unreadable_image", "corrupt JPEG")
    add_good(llava("gray.jpg"), "grayscale JPEG")
    add_bad(llava("../secret.jpg"), "image_path_escape", "relative path escaping the image root")
    add_bad(llava("../../etc/passwd"), "image_path_escape", "../../etc/passwd")
    add_bad(llava(str((root / "secret.jpg").resolve())), "image_path_escape", "absolute path")
    add_bad(llava("good.jpg", q="What is this?"), "image_tag_mismatch", "image without <image> tag")
    add_bad(llava(None, q="<image>\n<image>\nCompare."), "image_tag_mismatch", "two tags, no image")
    add_bad(json.dumps({"conversations": []}), "empty_conversation", "empty conversation")
    add_bad(json.dumps({"messages": [], "images": []}), "empty_conversation", "empty ShareGPT messages")
    add_bad(json.dumps([1, 2, 3]), "malformed_record", "a JSON array, not an object")
    add_good(llava("tiny.png"), "10x10 image")
    add_bad(llava("thin.png"), "image_aspect_ratio", "6000x28 image")
    add_good(llava(None, q=random_words(rng, 5), a=random_words(rng, 8)))
    add_good(json.dumps({"image": "good.jpg", "caption": "a caption"}))
    jsonl = root / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    return BadData(jsonl, img_dir, len(lines), len(lines) - len(bad), tuple(bad), tuple(odd))


def read_arrow_bins(path: Path) -> list[dict]:
    """Rows of one Arrow shard as dicts, read with plain `pyarrow.ipc.open_file`."""
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        return pa.ipc.open_file(source).read_all().to_pylist()


def read_wds_bins(path: Path) -> list[dict]:
    """Bins of one tar shard read with plain `webdataset`, decoded to the Arrow row layout."""
    import io

    import webdataset as wds

    rows = []
    for sample in wds.WebDataset(str(path), shardshuffle=False):
        meta = json.loads(sample["json"])
        arr = lambda name, s=sample: np.load(io.BytesIO(s[f"{name}.npy"]), allow_pickle=False)  # noqa: E731
        images = [sample[f"img{i}.{fmt}"] for i, fmt in enumerate(meta["image_formats"])]
        rows.append(
            {
                "key": sample["__key__"],
                "input_ids": arr("input_ids").tolist(),
                "loss_mask": arr("loss_mask").tolist(),
                "seq_lens": arr("seq_lens").tolist(),
                "sample_ids": meta["sample_ids"],
                "images": images,
                "image_formats": meta["image_formats"],
                "image_grid_thw": arr("image_grid_thw").tolist(),
            }
        )
    return rows


def small_job_config(raw: tuple[Path, Path], out: str | Path, **kw: Any) -> Any:
    """A `PackJobConfig` for a small (records, tokenizer) pair: seq_len 1024, both formats, 3 bins per shard,
    chunks of 8 records (so a few dozen records make several chunks and shards); `kw` (packing options,
    `mmpack.offline_packing.options`) overrides."""
    from mmpack.offline_packing.options import job_config

    src, tok = raw
    base: dict[str, Any] = dict(
        inputs=(str(src),),
        output=str(out),
        seq_len=1024,
        tokenizer=str(tok),
        format="both",
        max_bins_per_shard=3,
        chunk_size=8,
        progress=False,
    )
    base.update(kw)
    return job_config(**base)


def dataset_files(out: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file of a packed dataset folder (work folder and the folder's ownership
    marker, which records when and by whom it was made, excluded)."""
    from mmpack.packing.ownership import MARKER_NAME

    out = Path(out)
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and "_work" not in p.relative_to(out).parts and p.name != MARKER_NAME
    }


if __name__ == "__main__":
    raise SystemExit(main())
