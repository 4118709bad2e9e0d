"""benchmarks/gpu_check.sh --dry-run: the GPU check's phases (equality, throughput, save/load/resume) run on
CPU, so the script keeps working where CI has no GPU."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.support.trainer import REPO

pytestmark = pytest.mark.slow


@pytest.mark.ranks
def test_gpu_check_dry_run(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    for row in ("equality", "throughput", "resume", "cp2", "wall"):
        assert any(line.startswith(row) for line in proc.stdout.splitlines()), proc.stdout
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["equality"]["ok"] and result["resume"]["ok"]
    assert result["resume"]["iterations"] == [3, 4] and result["resume"]["same_data"]
    assert result["throughput"]["tokens_per_s"] > 0 and result["throughput"]["tflops_per_gpu"] > 0
    assert result["throughput"]["mfu"] is None  # no peak known on CPU
    cp = result["context_parallel"]  # CP 2 (two gloo ranks) against CP 1 on the same bins
    assert cp["ok"] and "skipped" not in cp and cp["max_rel_loss_diff"] < 1e-5, cp


def test_gpu_check_without_cuda_says_to_dry_run() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs the real check")
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_check.sh")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "use --dry-run" in proc.stderr
