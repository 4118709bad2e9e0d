"""Helpers for trainer tests (no tests here): a small real packed dataset and torchrun launches of
mmpack.trainer.pretrain_vlm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from mmpack.offline_packing.demo.synthetic import build_packed_dataset

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_packed_dataset(root: Path, *, n_samples: int, seed: int, seq_len: int = 256) -> Path:
    """Synthetic raw records and a tiny BPE, packed by the real offline job; returns the dataset folder."""
    return build_packed_dataset(
        root,
        n_samples=n_samples,
        seed=seed,
        tokenizer_seed=0,
        seq_len=seq_len,
        fmt="arrow",
        max_bins_per_shard=1024,
        size_range=(28, 84),
        max_words=30,
    )


@dataclass
class Run:
    """Outcome of one training launch."""

    returncode: int
    stdout: str
    stderr: str
    metrics: list[dict]

    @property
    def train(self) -> list[dict]:
        return [m for m in self.metrics if "loss" in m]

    @property
    def evals(self) -> list[dict]:
        return [m for m in self.metrics if "eval_loss" in m]

    def losses(self) -> list[float]:
        return [m["loss"] for m in self.train]


def ok(run: Run) -> Run:
    """``run``, after checking that it exited 0 (showing the tail of its stderr if not)."""
    assert run.returncode == 0, run.stderr[-5000:]
    return run


TINY = [
    "--num-layers",
    "4",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--vision-num-layers",
    "1",
    "--vision-hidden-size",
    "32",
    "--vision-num-attention-heads",
    "2",
    "--num-workers",
    "0",
]


def train(
    nproc: int,
    args: list[str],
    workdir: Path,
    *,
    timeout_s: int = 420,
    env: dict[str, str] | None = None,
    tiny: bool = True,
) -> Run:
    """Runs ``torchrun --nproc_per_node nproc -m mmpack.trainer.pretrain_vlm`` with a tiny model (the size
    flags of ``TINY``; ``tiny=False``: no size flags, for a model that brings its config.json)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = workdir / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        "-m",
        "mmpack.trainer.pretrain_vlm",
        *(TINY if tiny else ["--num-workers", "0"]),
        *args,
        "--metrics-file",
        str(metrics_file),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **(env or {})}
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=timeout_s)
    metrics = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    )
    return Run(proc.returncode, proc.stdout, proc.stderr, metrics)


def checkpoint_view(ckpt: Path, iteration: int, tmp: Path) -> Path:
    """A checkpoint folder under ``tmp`` whose latest iteration is ``iteration`` (links to the saved files)."""
    view = tmp / "ckpt-view"
    view.mkdir()
    (view / f"iter_{iteration:07d}").symlink_to(ckpt / f"iter_{iteration:07d}")
    (view / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return view
