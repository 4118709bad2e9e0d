"""benchmarks/gpu_check.py --dry-run: the GPU check's phases (equality, throughput, save/load/resume, CP 2) run
on CPU, so the script keeps working where CI has no GPU. Its driver runs in the test's process: the equality
worker is started by the script's own torchrun launch, its training runs on warm ranks (the same command
lines, without a fresh interpreter per rank); `gpu_check.sh` itself runs in the second test."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support import ranks
from tests.support.trainer import REPO

pytestmark = pytest.mark.slow


def _gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py as a module (benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.ranks
def test_gpu_check_dry_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "path", list(sys.path))  # gpu_check.py puts the repository first on it
    gpu_check = _gpu_check()
    by_torchrun = gpu_check._torchrun
    launched: list[str] = []

    def warm_torchrun(args: list[str], *, timeout_s: int, nproc: int = 1) -> subprocess.CompletedProcess:
        """The equality worker by the script's real torchrun; the training runs (``-m
        mmpack.trainer.pretrain_vlm``) on warm ranks, checked as the script checks them (exit 0)."""
        if "--equality-worker" in args:
            launched.append("torchrun")
            return by_torchrun(args, timeout_s=timeout_s, nproc=nproc)
        launched.append(f"warm x{nproc}")
        run = ranks.launch(nproc, args, tmp_path / f"launch{len(launched)}", timeout_s=timeout_s)
        ranks.checked(run)
        return subprocess.CompletedProcess(args, 0, run.stdout, run.stderr)

    monkeypatch.setattr(gpu_check, "_torchrun", warm_torchrun)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--dry-run", "--out", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    # equality; the uninterrupted run (throughput, the reference); resumed; CP 2
    assert launched == ["torchrun", "warm x1", "warm x1", "warm x2"], launched
    for row in ("equality", "throughput", "resume", "cp2", "wall"):
        assert any(line.startswith(row) for line in stdout.splitlines()), stdout
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
