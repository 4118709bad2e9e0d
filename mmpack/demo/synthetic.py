"""Synthetic raw datasets and a tiny tokenizer, for demos, tests and benchmarks.

`make_synthetic_dataset` writes real JPEG/PNG files of varied sizes with Pillow and a JSONL file mixing
LLaVA, ShareGPT, caption and text-only records; `train_tiny_bpe` trains a small byte-level BPE with the
Qwen chat/vision special tokens (deterministic, well under a second).

Everything is a pure function of its arguments (seeded), so two calls give identical bytes.
Command line: `python -m mmpack.demo.synthetic OUT_DIR --samples 1000 [--tokenizer]`.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

if TYPE_CHECKING:
    from mmpack.offline_packing.summary import PackSummary

from mmpack.offline_packing.options import job_config
from mmpack.packing.tokenizer import SPECIAL_TOKENS as CHAT_SPECIAL_TOKENS
from mmpack.packing.tokenizer import VIDEO_PAD

SPECIAL_TOKENS = tuple(CHAT_SPECIAL_TOKENS.values())  # the control tokens the packer expects
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
    video_paths: tuple[Path, ...] = ()  # clips added by `mmpack.demo.videos.add_synthetic_videos`

    @property
    def n_images(self) -> int:
        return len(self.image_paths)

    @property
    def image_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.image_paths)


def random_words(rng: random.Random, n: int) -> str:
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
    answer = lambda: random_words(rng, _sentence_count(rng, max_words))  # noqa: E731
    if fmt == "caption":
        return {"id": f"cap-{idx}", "image": images[0], "caption": answer()}
    n_turns = rng.choice((1, 1, 1, 2, 3))
    turns = []
    for t in range(n_turns):
        # image j goes into user turn min(j, last): LLaVA style "<image>\n" before the question
        tags = "".join("<image>\n" for j in range(len(images)) if min(j, n_turns - 1) == t)
        question = rng.choice(_QUESTIONS) if images else random_words(rng, rng.randint(3, 12)) + "?"
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
    lines += [random_words(rng, rng.randint(4, 30)) for _ in range(n_lines)]
    lines += ["system user assistant You are a helpful assistant.", "\n".join(_QUESTIONS)]
    return lines


def train_tiny_bpe(directory: Path, vocab_size: int = 600, seed: int = 0, *, video_pad: bool = False) -> Path:
    """Train a small byte-level BPE (Qwen special tokens included; `<|video_pad|>` right after `<|image_pad|>`
    with `video_pad`, as in Qwen's vocabulary) and save `directory/tokenizer.json`.

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
        special_tokens=[*SPECIAL_TOKENS, *((VIDEO_PAD,) if video_pad else ())],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_corpus(seed, 400), trainer=trainer)
    out = directory / "tokenizer.json"
    out.write_text(tok.to_str(pretty=True))
    return out


def build_packed_dataset(
    root: str | Path,
    *,
    n_samples: int = 96,
    seq_len: int = 384,
    fmt: str = "both",
    max_bins_per_shard: int = 4,
    seed: int = 0,
    tokenizer_seed: int | None = None,
    size_range: tuple[int, int] = (28, 120),
    max_words: int = 30,
    record_formats: Sequence[str] | None = None,
) -> Path:
    """Synthetic raw records and a tiny BPE under `root`, packed by the real offline job (`run_pack`).

    Returns the packed dataset folder (`root/packed`). `tokenizer_seed` defaults to `seed`.
    """
    root = Path(root)
    data = make_synthetic_dataset(
        root / "raw",
        n_samples=n_samples,
        seed=seed,
        formats=RECORD_FORMATS if record_formats is None else tuple(record_formats),
        size_range=size_range,
        max_words=max_words,
    )
    tokenizer = train_tiny_bpe(root / "tokenizer", seed=seed if tokenizer_seed is None else tokenizer_seed)
    out = root / "packed"
    pack_synthetic(
        data, tokenizer, out, seq_len=seq_len, format=fmt, max_bins_per_shard=max_bins_per_shard, seed=seed
    )
    return out


def pack_synthetic(
    data: SyntheticData, tokenizer: Path, output: Path, *, seq_len: int, **options: Any
) -> PackSummary:
    """Packs `data` with `tokenizer` into `output` by the real offline job; `options` are packing options
    (`mmpack.offline_packing.options`). Progress bars are off unless `progress=True` is given.
    """
    from mmpack.offline_packing.pipeline import run_pack

    cfg = job_config(
        inputs=(str(data.jsonl_path),),
        image_root=str(data.image_root),
        output=str(output),
        seq_len=seq_len,
        tokenizer=str(tokenizer),
        **{"progress": False, **options},
    )
    return run_pack(cfg)


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
