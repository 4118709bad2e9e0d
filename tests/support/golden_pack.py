"""Golden outputs of `mmpack pack`: the sha256 of every file a set of packing jobs writes, recorded once in
`tests/golden/pack_sha256.json` and compared by `tests/test_golden_pack.py`, so a change that should not
change any output byte (a refactor) is shown not to.

The jobs run through the command line (`mmpack pack` flags), which stay the same across such changes, over
the shared demo data (LLaMA-Factory's mllm_demo images and videos, the real Qwen3 tokenizer; skipped when
absent) and over held-in data this module writes itself (synthetic records with every kind of bad input and
the byte-level tokenizer). Sample ids and reject rows name their input files, so every job reads from one
fixed folder (`GOLDEN_ROOT`), held under a file lock while the jobs run.

Record anew (after a change that is meant to change the outputs): `python -m tests.support.golden_pack --write`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

GOLDEN_ROOT = Path("/tmp/mmpack-golden-pack")
GOLDEN_FILE = Path(__file__).resolve().parents[1] / "golden" / "pack_sha256.json"


def shared_data() -> Path | None:
    """The shared data folder (`tests.support.shared.SHARED_DIR`), or None where a part the jobs use is absent."""
    from tests.support.shared import SHARED_DIR

    root = SHARED_DIR / "data"
    needed = ("mllm_demo/data/mllm_demo.json", "mllm_video_demo/mllm_video_demo.json", "tokenizer_qwen3")
    return root if all((root / p).exists() for p in needed) else None


def _prepare_shared(shared: Path, root: Path) -> None:
    shutil.copytree(shared / "mllm_demo" / "data", root / "demo")
    shutil.copytree(shared / "mllm_video_demo", root / "video")
    shutil.copytree(shared / "tokenizer_qwen3", root / "qwen3")
    model = root / "model"  # an HF model folder: tokenizer, chat template, preprocessor config
    shutil.copytree(shared / "tokenizer_qwen3", model)
    processor = {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": 14,
        "merge_size": 2,
        "temporal_patch_size": 2,
        "min_pixels": 6272,
        "max_pixels": 301056,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "rescale_factor": 0.00392156862745098,
        "resample": 2,
    }
    (model / "preprocessor_config.json").write_text(json.dumps(processor, indent=1))


def _prepare_held_in(root: Path) -> None:
    from tests.support.fixtures_data import make_bad_dataset, make_synthetic_dataset

    make_synthetic_dataset(root / "syn", n_samples=90, seed=5, size_range=(30, 420), max_words=60)
    make_bad_dataset(root / "bad", seed=3)


def jobs(root: Path, with_shared: bool) -> dict[str, list[str]]:
    """Job name -> `mmpack pack` flags (inputs, tokenizers and outputs under `root`)."""
    syn, bad = root / "syn" / "data.jsonl", root / "bad" / "bad.jsonl"
    out = {
        "held_in_both": [
            *("-i", str(syn), "-i", str(bad), "-t", "byte-fallback", "-L", "700", "-f", "both"),
            *("-M", "4", "--max-images-per-bin", "2", "--max-bins-per-shard", "3", "--chunk-size", "16"),
            *("-w", "2", "--seed", "2", "--image-check", "decode", "--max-record-bytes", "64K"),
        ],
        "held_in_truncate": [
            *("-i", str(syn), "-t", "byte-fallback", "-L", "160", "--overlength", "truncate"),
            *("-f", "wds", "--max-shard-bytes", "96K", "--min-pixels", "1568", "--max-pixels", "40000"),
            *("--patch-size", "14", "--merge-size", "2", "--algorithm", "ffd", "--shard-prefix", "trunc_a"),
            *("--default-system", "Answer briefly.", "--max-image-pixels", "150000"),
        ],
    }
    if with_shared:
        demo, video = root / "demo" / "mllm_demo.json", root / "video" / "mllm_video_demo.json"
        qwen3 = str(root / "qwen3")
        out |= {
            "demo_both": ["-i", str(demo), "-t", qwen3, "-L", "1024", "-f", "both"],
            "demo_small_energon": [
                *("-i", str(demo), "-t", qwen3, "-L", "300", "--overlength", "truncate", "-f", "wds"),
                *("--energon", "--max-pixels", "200000", "--min-pixels", "10000", "--seed", "5"),
                *("--max-bins-per-shard", "2", "--no-default-system"),
            ],
            "demo_model_folder": [
                *("-i", str(demo), "--model", str(root / "model"), "-L", "2048", "-M", "2"),
                *("--chat-template", "builtin", "--default-system", "You are a careful assistant."),
            ],
            "video_both": [
                *("-i", str(video), "-t", qwen3, "-L", "8192", "-f", "both", "--video-fps", "1"),
                *("--video-max-frames", "8", "--video-max-pixels", "150528", "--video-min-frames", "2"),
            ],
            "video_total_pixels": [
                *("-i", str(video), "-t", qwen3, "-L", "4096", "--video-total-pixels", "2000000"),
                *("--video-min-pixels", "6272", "--max-video-seconds", "60", "--temporal-patch-size", "2"),
            ],
        }
    return out


def output_hashes(out: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file of a packed output (its work folder and ownership marker,
    which records when it was made, excluded)."""
    from tests.support.fixtures_data import dataset_files

    return {rel: hashlib.sha256(data).hexdigest() for rel, data in dataset_files(out).items()}


@contextlib.contextmanager
def golden_root() -> Iterator[Path]:
    """`GOLDEN_ROOT`, emptied, held under a lock for the block (another checkout may be running the jobs)."""
    GOLDEN_ROOT.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{GOLDEN_ROOT}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        shutil.rmtree(GOLDEN_ROOT, ignore_errors=True)
        GOLDEN_ROOT.mkdir()
        try:
            yield GOLDEN_ROOT
        finally:
            shutil.rmtree(GOLDEN_ROOT, ignore_errors=True)


def run_jobs(names: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Job name -> output hashes of the jobs named (default: all that the data here allows)."""
    from mmpack.cli import main as mmpack

    shared = shared_data()
    with golden_root() as root:
        _prepare_held_in(root)
        if shared is not None:
            _prepare_shared(shared, root)
        result = {}
        for name, flags in jobs(root, shared is not None).items():
            if names is not None and name not in names:
                continue
            out = root / "out" / name
            code = mmpack(["pack", *flags, "-o", str(out), "--no-progress"])
            if code != 0:
                raise RuntimeError(f"golden job {name} failed with exit code {code}")
            result[name] = output_hashes(out)
        return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"record the hashes in {GOLDEN_FILE}")
    args = p.parse_args(argv)
    if shared_data() is None:
        print("golden_pack: the shared data is absent; its jobs are left out", file=sys.stderr)
    hashes = run_jobs()
    text = json.dumps(hashes, indent=1, sort_keys=True) + "\n"
    if args.write:
        GOLDEN_FILE.parent.mkdir(exist_ok=True)
        GOLDEN_FILE.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
