"""Three packed sources that mix although their image rules differ, packed by `mmpack pack` as users do: a text
corpus with `-t TOKENIZER` alone (its image rule, patch 16, is none of the images' concern), and one image set
packed twice with `--model DIR` (a folder with the same tokenizer.json and a preprocessor_config.json of patch
14, merge 2), under two `--max-pixels` (and the smaller one under a `--max-image-pixels` that rejects the larger
images the other keeps). No pytest dependency; the session fixture is `mixed_rule_sources`."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from mmpack.demo.synthetic import make_synthetic_dataset, train_tiny_bpe
from mmpack.packing.image_tokens import CLIP_MEAN, CLIP_STD

MODEL_PIXELS = {"min_pixels": 784, "max_pixels": 3136}  # the model folder's processor
PIXEL_BUDGETS = {"img-small": 1568, "img-large": 12544}  # --max-pixels of each image source
SMALL_IMAGE_LIMIT = 6000  # img-small's --max-image-pixels: rejects larger images, which img-large keeps
WEIGHTS = {"text": 0.4, "img-small": 0.3, "img-large": 0.3}


@dataclass(frozen=True)
class MixedRuleSources:
    """The sources (by name, each folder named so), the model folder and the raw image records' folder."""

    sources: dict[str, Path]
    model: Path
    raw_images: Path

    def data_path_args(self) -> list[str]:
        """`--data-path W1 A W2 B ...` of the three sources, text first."""
        return ["--data-path", *(str(x) for n, p in self.sources.items() for x in (WEIGHTS[n], p))]

    def pairs(self) -> list[tuple[float, str]]:
        """The mixture as `build_loader` takes it: (weight, path), text first."""
        return [(WEIGHTS[n], str(p)) for n, p in self.sources.items()]


def write_model_folder(folder: Path, tokenizer: Path) -> Path:
    """The two files `mmpack pack --model` reads: tokenizer.json and a Qwen2-VL preprocessor_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer, folder / "tokenizer.json")
    config = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": 14, "merge_size": 2, "temporal_patch_size": 2, **MODEL_PIXELS,
        "image_mean": list(CLIP_MEAN), "image_std": list(CLIP_STD), "rescale_factor": 1 / 255, "resample": 3,
    }  # fmt: skip
    (folder / "preprocessor_config.json").write_text(json.dumps(config, indent=1))
    return folder


def make_mixed_rule_sources(root: Path, *, n_samples: int = 120, seq_len: int = 256) -> MixedRuleSources:
    """Packs the three sources under `root` (a few seconds); the tokenizer is the tiny BPE of seed 0, the one
    `tests.support.trainer.make_packed_dataset` packs with."""
    from mmpack.cli import main as mmpack

    root = Path(root)
    tokenizer = train_tiny_bpe(root / "tokenizer", seed=0)
    model = write_model_folder(root / "model", tokenizer)
    text = make_synthetic_dataset(root / "raw-text", n_samples, seed=3, formats=("text",), max_words=30)
    images = make_synthetic_dataset(
        root / "raw-images", n_samples, seed=4, formats=("llava", "sharegpt", "caption"),
        size_range=(28, 112), max_words=30,
    )  # fmt: skip
    common = ["-L", str(seq_len), "-f", "arrow", "--max-bins-per-shard", "1024", "--no-progress"]
    sources = {"text": root / "text", **{name: root / name for name in PIXEL_BUDGETS}}
    packs = {
        "text": ["-i", str(text.jsonl_path), "-t", str(tokenizer), "--patch-size", "16"],
        **{
            name: ["-i", str(images.jsonl_path), "-r", str(images.image_root), "--model", str(model),
                   "--max-pixels", str(budget)]
            for name, budget in PIXEL_BUDGETS.items()
        },
    }  # fmt: skip
    packs["img-small"] += ["--max-image-pixels", str(SMALL_IMAGE_LIMIT)]
    for name, args in packs.items():
        code = mmpack(["pack", *args, "-o", str(sources[name]), *common])
        if code != 0:
            raise RuntimeError(f"mmpack pack of the {name} source exited {code}")
    return MixedRuleSources(sources=sources, model=model, raw_images=images.image_root)
