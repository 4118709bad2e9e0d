"""Helpers for trainer tests (no tests here): a small real packed dataset and torchrun launches of
mmpack.trainer.pretrain_vlm."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from mmpack.demo.synthetic import build_packed_dataset
from tests.support import ranks

REPO = Path(__file__).resolve().parents[2]


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
    launch: ranks.Launch | None = None

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
    assert run.returncode == 0, run.launch.report() if run.launch else run.stderr[-5000:]
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
    entry: tuple[str, ...] = ("-m", "mmpack.trainer.pretrain_vlm"),
) -> Run:
    """Runs ``mmpack.trainer.pretrain_vlm`` on ``nproc`` warm ranks (``tests.support.ranks``, as ``torchrun
    --nproc_per_node nproc -m mmpack.trainer.pretrain_vlm``) with a tiny model (the size flags of ``TINY``;
    ``tiny=False``: no size flags, for a model that brings its config.json); ``send``: a signal to one of its
    ranks during the run; ``entry``: what each rank runs in place of ``-m mmpack.trainer.pretrain_vlm`` (a
    script path that sets something up, then calls its ``main``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics_file = workdir / "metrics.jsonl"
    metrics_file.unlink(missing_ok=True)
    argv = [
        *entry,
        *(TINY if tiny else ["--num-workers", "0"]),
        *args,
        "--metrics-file",
        str(metrics_file),
    ]
    deadline = time.monotonic() + timeout_s

    def signal_when_logged(procs: list) -> None:
        if send is not None:
            _signal_when_logged(procs, metrics_file, send, deadline=deadline)

    launch = ranks.launch(
        nproc, argv, workdir / "ranks", env=env, timeout_s=timeout_s, while_running=signal_when_logged
    )
    metrics = (
        [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    )
    return Run(launch.returncode, launch.stdout, launch.stderr, metrics, launch)


def _signal_when_logged(procs: list, metrics_file: Path, send: Signal, *, deadline: float) -> None:
    """Waits until ``metrics_file`` holds ``send.after_iteration`` steps, then signals the rank."""
    while time.monotonic() < deadline and all(p.exitcode is None for p in procs):
        lines = metrics_file.read_text().splitlines() if metrics_file.exists() else []
        if sum('"loss"' in line for line in lines) >= send.after_iteration:
            os.kill(procs[send.rank].pid, send.signum)
            return
        time.sleep(0.05)
    raise AssertionError(f"the run ended or timed out before iteration {send.after_iteration}")


def checkpoint_view(ckpt: Path, iteration: int, tmp: Path) -> Path:
    """A checkpoint folder under ``tmp`` whose latest iteration is ``iteration`` (links to the saved files)."""
    view = tmp / "ckpt-view"
    view.mkdir()
    (view / f"iter_{iteration:07d}").symlink_to(ckpt / f"iter_{iteration:07d}")
    (view / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return view


def check_continues(resumed: Run, full: Run, *, save_at: int, total: int) -> None:
    """``resumed`` (a run resumed from the checkpoint of iteration ``save_at``) continues ``full`` (the
    uninterrupted run of ``total`` iterations): the same iterations, bins and token checksums, learning rates
    to 1e-9 and losses to 1e-4 (relative)."""
    tail = [m for m in full.train if m["iteration"] > save_at]
    assert [m["iteration"] for m in resumed.train] == list(range(save_at + 1, total + 1))
    assert [m["bins_consumed"] for m in resumed.train] == [m["bins_consumed"] for m in tail]
    assert [m["data_digest"] for m in resumed.train] == [m["data_digest"] for m in tail]
    for mine, ref in zip(resumed.train, tail, strict=True):
        assert mine["lr"] == pytest.approx(ref["lr"], rel=1e-9)
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4), (mine, ref)
