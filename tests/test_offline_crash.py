"""Crash safety: a job killed with SIGKILL in the middle of the write stage, rerun with the same arguments,
ends with output byte-identical to an uninterrupted run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmpack.offline_packing.options import job_config, with_options
from mmpack.offline_packing.pipeline import run_pack
from tests.support.fixtures_data import dataset_files, make_synthetic_dataset, train_tiny_bpe

REPO = Path(__file__).resolve().parents[1]


def _flags(data, tok: Path, out: Path) -> list[str]:
    return ["-i", str(data.jsonl_path), "-o", str(out), "-L", "1024", "-t", str(tok), "-f", "both"]


def _kill_during_write(argv: list[str], shard_dir: Path, timeout_s: float = 60) -> bool:
    """Start the write stage, SIGKILL it once a shard is complete and the next one is in progress.

    Returns False if the process finished before it could be killed.
    """
    proc = subprocess.Popen([sys.executable, "-m", "mmpack.offline_packing.write", *argv], cwd=REPO)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if shard_dir.is_dir():
                names = os.listdir(shard_dir)
                if any(n.endswith(".arrow") and not n.startswith(".") for n in names) and any(
                    ".tmp-" in n for n in names
                ):
                    proc.send_signal(signal.SIGKILL)
                    proc.wait()
                    return True
            time.sleep(0.001)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return False


@pytest.mark.slow
def test_sigkill_during_write_then_rerun_is_byte_identical(tmp_path: Path) -> None:
    data = make_synthetic_dataset(tmp_path / "raw", n_samples=120, seed=5, size_range=(100, 400))
    tok = train_tiny_bpe(tmp_path / "tok")
    reference = tmp_path / "reference"
    cfg = dict(
        inputs=(str(data.jsonl_path),), seq_len=1024, tokenizer=str(tok), format="both", max_bins_per_shard=1
    )
    run_pack(job_config(output=str(reference), progress=False, **cfg))  # type: ignore[arg-type]
    expected = dataset_files(reference)

    killed = False
    for attempt in range(3):
        out = tmp_path / f"crashed{attempt}"
        job = job_config(output=str(out), progress=False, **cfg)  # type: ignore[arg-type]
        for stage in (1, 2, 3):
            run_pack(with_options(job, only_stage=stage))
        argv = [*_flags(data, tok, out), "--max-bins-per-shard", "1", "--no-progress"]
        if _kill_during_write(argv, out / "shards"):
            killed = True
            break
    assert killed, "the write stage always finished before it could be killed"
    assert not (out / "manifest.json").exists()  # killed before the commit point
    complete = [n for n in os.listdir(out / "shards") if not n.startswith(".")]
    assert 0 < len(complete) < len(os.listdir(reference / "shards"))  # interrupted between first and last

    rerun = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmpack.cli",
            "pack",
            *_flags(data, tok, out),
            "--max-bins-per-shard",
            "1",
            "--no-progress",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert "skipped (already complete)" in rerun.stderr  # stages 1-3 were not redone
    assert dataset_files(out) == expected
