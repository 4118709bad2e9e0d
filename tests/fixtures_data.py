"""Synthetic raw datasets and a tiny tokenizer for tests and benchmarks (no pytest dependency).

`make_synthetic_dataset` writes real JPEG/PNG files of varied sizes with Pillow and a JSONL file mixing
LLaVA, ShareGPT, caption and text-only records; `train_tiny_bpe` trains a small byte-level BPE with the
Qwen special tokens; `make_bad_dataset` writes one record per kind of bad input, with the expected reason.

Everything is a pure function of its arguments (seeded), so two calls give identical bytes.
Command line (for benchmarks or by hand): `python -m tests.fixtures_data OUT_DIR --samples 1000`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
)
RECORD_FORMATS = ("llava", "sharegpt", "caption", "text")

_SYLLABLES = [
    "ka",
    "ro",
    "mi",
    "to",
    "na",
    "se",
    "lu",
    "vi",
    "pe",
    "da",
    "go",
    "ri",
    "ze",
    "sha",
    "ne",
    "mo",
    "tu",
    "li",
    "fa",
    "bo",
    "ki",
    "ya",
    "re",
    "no",
    "wa",
    "chi",
    "su",
]
_QUESTIONS = (
    "What is shown here?",
    "Describe this image in detail.",
    "How many objects can you see?",
    "What colour dominates the picture?",
    "Is there anything unusual?",
    "Where might this photo have been taken?",
)


@dataclass(frozen=True)
class SyntheticData:
    """What `make_synthetic_dataset` wrote."""

    jsonl_path: Path
    image_root: Path
    n_samples: int
    image_paths: tuple[Path, ...]
    records: tuple[dict, ...] = field(repr=False)
    counts_by_format: dict[str, int] = field(default_factory=dict)

    @property
    def n_images(self) -> int:
        return len(self.image_paths)

    @property
    def image_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.image_paths)


def _words(rng: random.Random, n: int) -> str:
    words = ("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(n))
    return " ".join(words)


def _sentence_count(rng: random.Random, max_words: int) -> int:
    # long-tailed lengths, like real answers: most short, a few long
    return max(1, min(max_words, int(rng.paretovariate(1.3) * 6)))


def write_image(path: Path, width: int, height: int, rng: random.Random, fmt: str = "JPEG") -> Path:
    """Write a smooth random image (upsampled noise) of the given size; fast and compressible."""
    seed_arr = np.random.default_rng(rng.getrandbits(32)).integers(0, 256, (6, 6, 3), dtype=np.uint8)
    img = Image.fromarray(seed_arr, "RGB").resize((width, height), Image.Resampling.BILINEAR)
    path.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "JPEG":
        img.save(path, format="JPEG", quality=85)
    else:
        img.save(path, format=fmt)
    return path


def _make_images(
    image_root: Path, n: int, rng: random.Random, size_range: tuple[int, int], png_fraction: float
) -> list[Path]:
    lo, hi = size_range
    paths = []
    for i in range(n):
        w, h = rng.randint(lo, hi), rng.randint(lo, hi)
        is_png = rng.random() < png_fraction
        rel = Path("images") / f"{i // 1000:03d}" / f"img_{i:06d}.{'png' if is_png else 'jpg'}"
        paths.append(write_image(image_root / rel, w, h, rng, "PNG" if is_png else "JPEG"))
    return paths


def _record(fmt: str, idx: int, rng: random.Random, images: list[str], max_words: int) -> dict:
    """One raw record of format `fmt` referencing `images` (relative paths)."""
    answer = lambda: _words(rng, _sentence_count(rng, max_words))  # noqa: E731
    if fmt == "caption":
        return {"id": f"cap-{idx}", "image": images[0], "caption": answer()}
    n_turns = rng.choice((1, 1, 1, 2, 3))
    turns = []
    for t in range(n_turns):
        # image j goes into user turn min(j, last): LLaVA style "<image>\n" before the question
        tags = "".join("<image>\n" for j in range(len(images)) if min(j, n_turns - 1) == t)
        question = rng.choice(_QUESTIONS) if images else _words(rng, rng.randint(3, 12)) + "?"
        turns.append((tags + question, answer()))
    if fmt == "llava":
        conv = []
        if rng.random() < 0.2:
            conv.append({"from": "system", "value": "You are a helpful assistant."})
        for q, a in turns:
            conv += [{"from": "human", "value": q}, {"from": "gpt", "value": a}]
        rec: dict = {"id": f"llava-{idx}", "conversations": conv}
        if images:
            rec["image"] = images[0] if len(images) == 1 else list(images)
        return rec
    msgs = []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    rec = {"messages": msgs}
    if images:
        rec["images"] = list(images)
    return rec


def make_synthetic_dataset(
    root: Path,
    n_samples: int = 64,
    seed: int = 0,
    formats: Sequence[str] = RECORD_FORMATS,
    *,
    n_images: int | None = None,
    size_range: tuple[int, int] = (48, 640),
    png_fraction: float = 0.1,
    max_images_per_sample: int = 2,
    max_words: int = 200,
    jsonl_name: str = "data.jsonl",
) -> SyntheticData:
    """Write `n_samples` raw records and their images under `root`.

    Args:
        root: output folder (created); images go under `root/images`, records in `root/<jsonl_name>`.
        n_samples: number of records.
        seed: all content is a pure function of the arguments.
        formats: record formats to cycle through ("llava", "sharegpt", "caption", "text").
        n_images: distinct image files (records reuse them); default one per image-bearing record.
        size_range: min and max of image width and height in pixels.
        png_fraction: share of images written as PNG (the rest JPEG).
        max_images_per_sample: LLaVA/ShareGPT records carry 1..this many images.
        max_words: cap on words per answer.
        jsonl_name: name of the JSONL file.
    """
    bad = [f for f in formats if f not in RECORD_FORMATS]
    if bad or not formats:
        raise ValueError(f"formats must be a non-empty subset of {RECORD_FORMATS}, got {list(formats)}")
    rng = random.Random(seed)
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    plan = [formats[i % len(formats)] for i in range(n_samples)]
    rng.shuffle(plan)
    img_counts = [
        0 if f == "text" else 1 if f == "caption" else rng.randint(1, max_images_per_sample) for f in plan
    ]
    n_distinct = n_images if n_images is not None else max(1, sum(1 for c in img_counts if c))
    image_paths = _make_images(root, n_distinct, rng, size_range, png_fraction) if any(img_counts) else []
    rel = [p.relative_to(root).as_posix() for p in image_paths]
    records, counts = [], dict.fromkeys(formats, 0)
    for i, (fmt, k) in enumerate(zip(plan, img_counts)):
        imgs = [rel[rng.randrange(len(rel))] for _ in range(k)]
        style = rng.choice(("llava", "sharegpt")) if fmt == "text" else fmt
        records.append(_record(style, i, rng, imgs, max_words))
        counts[fmt] += 1
    jsonl = root / jsonl_name
    jsonl.write_text("".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records))
    return SyntheticData(jsonl, root, n_samples, tuple(image_paths), tuple(records), counts)


def _training_corpus(seed: int, n_lines: int) -> list[str]:
    rng = random.Random(seed)
    lines = [q for q in _QUESTIONS]
    lines += [_words(rng, rng.randint(4, 30)) for _ in range(n_lines)]
    lines += ["system user assistant You are a helpful assistant.", "\n".join(_QUESTIONS)]
    return lines


def train_tiny_bpe(directory: Path, vocab_size: int = 600, seed: int = 0) -> Path:
    """Train a small byte-level BPE (Qwen special tokens included) and save `directory/tokenizer.json`.

    Deterministic: the same arguments give the same file. Takes well under a second.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed, 400), trainer=trainer)
    out = directory / "tokenizer.json"
    out.write_text(tok.to_str(pretty=True))
    return out


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
    image_too_small, image_aspect_ratio.
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
    Image.new("RGB", (10, 10), (1, 2, 3)).save(img_dir / "tiny.png")  # below one 28x28 merged patch
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
    add_bad(llava("tiny.png"), "image_too_small", "10x10 image")
    add_bad(llava("thin.png"), "image_aspect_ratio", "6000x28 image")
    add_good(llava(None, q=_words(rng, 5), a=_words(rng, 8)))
    add_good(json.dumps({"image": "good.jpg", "caption": "a caption"}))
    jsonl = root / "bad.jsonl"
    jsonl.write_text("\n".join(lines) + "\n")
    return BadData(jsonl, img_dir, len(lines), len(lines) - len(bad), tuple(bad), tuple(odd))


def main(argv: list[str] | None = None) -> int:
    """Write a synthetic dataset (and optionally a tiny tokenizer) from the command line."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--images", type=int, default=None, help="distinct image files (default: one per record)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-size", type=int, default=48)
    p.add_argument("--max-size", type=int, default=640)
    p.add_argument("--tokenizer", action="store_true", help="also train OUT/tokenizer/tokenizer.json")
    a = p.parse_args(argv)
    data = make_synthetic_dataset(
        a.out, a.samples, a.seed, n_images=a.images, size_range=(a.min_size, a.max_size)
    )
    print(f"{data.n_samples} records, {data.n_images} images ({data.image_bytes} bytes) -> {data.jsonl_path}")
    if a.tokenizer:
        print(f"tokenizer -> {train_tiny_bpe(a.out / 'tokenizer')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


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


def dataset_files(out: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file of a packed dataset folder (work folder excluded)."""
    out = Path(out)
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and "_work" not in p.relative_to(out).parts
    }
