"""Helpers for trainer tests (no tests here): a small real packed dataset and torchrun launches of
mmpack.trainer.pretrain_vlm."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
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


@dataclass(frozen=True)
class Signal:
    """A signal sent to one rank of a launch once the run has logged ``after_iteration`` steps."""

    signum: int
    rank: int
    after_iteration: int


def train(
    nproc: int,
    args: list[str],
    workdir: Path,
    *,
    timeout_s: int = 420,
    env: dict[str, str] | None = None,
    tiny: bool = True,
    send: Signal | None = None,
) -> Run:
    """Runs ``torchrun --nproc_per_node nproc -m mmpack.trainer.pretrain_vlm`` with a tiny model (the size
    flags of ``TINY``; ``tiny=False``: no size flags, for a model that brings its config.json); ``send``: a
    signal to one of its ranks during the run."""
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
    with subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as proc:
        try:
            if send is not None:
                _signal_when_logged(proc, metrics_file, send, deadline=time.monotonic() + timeout_s)
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except BaseException:
            proc.kill()
            raise
    metrics = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    )
    return Run(proc.returncode, stdout, stderr, metrics)


def _signal_when_logged(proc: subprocess.Popen, metrics_file: Path, send: Signal, *, deadline: float) -> None:
    """Waits until ``metrics_file`` holds ``send.after_iteration`` steps, then signals the rank."""
    while time.monotonic() < deadline and proc.poll() is None:
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        if sum('"loss"' in line for line in lines) >= send.after_iteration:
            os.kill(_worker_pid(proc.pid, send.rank), send.signum)
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or timed out before iteration {send.after_iteration}")


def _worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process of ``rank`` (Linux /proc: its children and their RANK)."""
    tasks = Path(f"/proc/{launcher_pid}/task")
    children = [pid for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
    for pid in children:
        if f"RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {children}")


def checkpoint_view(ckpt: Path, iteration: int, tmp: Path) -> Path:
    """A checkpoint folder under ``tmp`` whose latest iteration is ``iteration`` (links to the saved files)."""
    view = tmp / "ckpt-view"
    view.mkdir()
    (view / f"iter_{iteration:07d}").symlink_to(ckpt / f"iter_{iteration:07d}")
    (view / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return view
