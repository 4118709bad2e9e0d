"""TP x PP x DP training on CPU gloo processes, on packed datasets made by the real offline job: a mixture of a
text corpus packed with `-t` alone and one image set packed with `--model DIR` under two `--max-pixels`
(`support.mixed_sources`), each source's bins decoded by its own rule."""

from __future__ import annotations

import json
import math
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.mixed_sources import MixedRuleSources
from tests.support.trainer import Run, Signal, ok, train

pytestmark = [pytest.mark.ranks, pytest.mark.slow]

BATCH = ["--micro-batch-size", "1", "--global-batch-size", "8", "--seed", "5"]
# TP2 x PP2 with sequence parallelism and the distributed optimizer, 20 iterations (the 8-rank run, the resume)
RUN_3D = [
    "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
    "--sequence-parallel", "--use-distributed-optimizer",
    "--train-iters", "20", "--lr", "3e-3", "--lr-warmup-iters", "2",
    *BATCH,
]  # fmt: skip
PP1 = ["--pipeline-model-parallel-size", "1"]  # after RUN_3D: TP2 x PP1


@pytest.fixture(scope="module")
def datasets(
    mixed_rule_sources: MixedRuleSources, packed_dataset: Callable[..., Path]
) -> tuple[list[str], Path]:
    """The training data (`--data-path W1 A W2 B W3 C` of the three sources) and a held-out dataset."""
    return mixed_rule_sources.data_path_args(), packed_dataset(n_samples=60, seed=1)


@pytest.fixture(scope="module")
def run_3d(datasets: tuple[list[str], Path], tmp_path_factory: pytest.TempPathFactory) -> Run:
    train_set, held_out = datasets
    workdir = tmp_path_factory.mktemp("run-3d")
    args = [
        *train_set,
        "--eval-data-path",
        str(held_out),
        "--eval-interval",
        "10",
        *RUN_3D,
    ]
    return ok(train(8, args, workdir))


def test_tp2_pp2_dp2_trains_and_loss_falls(run_3d: Run) -> None:
    losses = run_3d.losses()
    assert [m["iteration"] for m in run_3d.train] == list(range(1, 21))
    assert all(math.isfinite(x) for x in losses)
    first, last5 = losses[0], sum(losses[-5:]) / 5
    assert last5 < first - 0.5, losses
    assert "world 8 = TP 2 x PP 2 x DP 2" in run_3d.stdout
    assert " iteration     20/    20 | lm loss:" in run_3d.stdout  # the log line users see
    lrs = [m["lr"] for m in run_3d.train]
    # Megatron-style linear warmup from 0 over 2 iterations, then cosine decay
    assert lrs[:3] == pytest.approx([0.0, 1.5e-3, 3e-3]) and lrs[-1] < lrs[3]
    assert all(0 < m["real_token_fraction"] <= 1 for m in run_3d.train)
    assert [e["iteration"] for e in run_3d.evals] == [10, 20]
    assert all(math.isfinite(e["eval_loss"]) for e in run_3d.evals)
    # every source of the mixture trained, the two image sources at their own pixel budgets
    tokens = {n: sum(m["source_tokens"][n] for m in run_3d.train) for n in ("text", "img-small", "img-large")}
    assert set(run_3d.train[0]["source_loss"]) == set(tokens) and min(tokens.values()) > 0, tokens


def test_layouts_agree_in_fp32(run_3d: Run, datasets: tuple[list[str], Path], tmp_path: Path) -> None:
    """Same seed and data: TP2xPP2xDP2 (with SP and the distributed optimizer), TP2 and one process."""
    train_set, _ = datasets
    args = [*train_set, "--train-iters", "3", "--lr", "3e-3", "--lr-warmup-iters", "2"]
    tp2 = ok(train(2, [*args, "--tensor-model-parallel-size", "2", *BATCH], tmp_path / "tp2"))
    single = ok(train(1, [*args, *BATCH], tmp_path / "single"))
    reference = run_3d.train[:3]
    for other in (tp2.train, single.train):
        assert [m["data_digest"] for m in other] == [m["data_digest"] for m in reference]
        for mine, ref in zip(other, reference, strict=True):
            assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4, abs=1e-5)
            assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3)


def test_bf16_with_fp32_flags_is_finite_and_close_to_fp32(
    run_3d: Run, datasets: tuple[list[str], Path], tmp_path: Path
) -> None:
    train_set, _ = datasets
    flags = [
        "--bf16",
        "--fp32-residual-connection",
        "--attention-softmax-in-fp32",
        "--accumulate-allreduce-grads-in-fp32",
        "--recompute-activations",
    ]
    args = [*train_set, "--train-iters", "3", "--lr", "3e-3", "--lr-warmup-iters", "2"]
    run = ok(train(2, [*args, "--tensor-model-parallel-size", "2", *flags, *BATCH], tmp_path / "bf16"))
    assert "| bf16 |" in run.stdout
    losses = run.losses()
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(run_3d.train[0]["loss"], rel=2e-2)


def test_fp16_overflow_skips_step_and_lowers_scale(datasets: tuple[list[str], Path], tmp_path: Path) -> None:
    train_set, _ = datasets
    args = [
        *train_set,
        "--fp16",
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "2",
        "--train-iters",
        "6",
        "--initial-loss-scale",
        "128",  # at 1024 the vision tower's patch-summed fp16 gradients overflow at iteration 2 by themselves
        "--hysteresis",
        "1",
        "--debug-overflow-iterations",
        "4",
        *BATCH,
    ]
    run = ok(train(4, args, tmp_path / "fp16"))  # the overflow is found on every TP rank and stage
    steps = {m["iteration"]: m for m in run.train}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    assert steps[4]["skipped"] and "iteration 4: skipped (gradient overflow)" in run.stdout
    assert steps[4]["loss_scale"] == steps[3]["loss_scale"] / 2
    assert steps[4]["lr"] == steps[5]["lr"], "a skipped step does not advance the LR schedule"
    for i in (1, 2, 3, 5, 6):
        assert math.isfinite(steps[i]["loss"]) and not steps[i]["skipped"], steps[i]


@pytest.fixture(scope="module")
def stopped(
    datasets: tuple[list[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Run, Path, Signal]:
    """RUN_3D at TP2 x PP1 x DP2 (4 ranks: the distributed optimizer sharded over two DP ranks, SP; the same
    losses as the TP2 x PP2 x DP2 run, to ~1e-8) with --exit-signal-handler, sent SIGTERM at one random rank of
    the four after a random step (a scheduler's signal reaches the ranks at different moments; here the extreme
    case)."""
    train_set, _ = datasets
    workdir = tmp_path_factory.mktemp("stopped")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    send = Signal(signal.SIGTERM, rank=rng.randrange(4), after_iteration=rng.randint(2, 6))
    print(f"{send} (seed {seed})")
    args = [*train_set, *RUN_3D, *PP1, "--save", str(workdir / "ckpt")]
    args.append("--exit-signal-handler")
    return ok(train(4, args, workdir, send=send)), workdir / "ckpt", send


def test_sigterm_at_a_random_step_saves_that_step_and_exits_zero(
    run_3d: Run, stopped: tuple[Run, Path, Signal]
) -> None:
    """Every rank finishes the step it is in, the same checkpoint of it is committed, the run exits 0 (ok());
    up to there it is the uninterrupted run."""
    run, ckpt, send = stopped
    step = run.train[-1]["iteration"]
    assert send.after_iteration <= step < 20, (send, step)
    assert [m["iteration"] for m in run.train] == list(range(1, step + 1))
    assert "world 4 = TP 2 x PP 1 x DP 2" in run.stdout
    assert f"exiting after iteration {step}: received SIGTERM; checkpoint of it in {ckpt}" in run.stdout
    assert "Traceback" not in run.stderr
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == str(step)
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{step:07d}"]  # no other save, no .tmp
    files = json.loads((ckpt / f"iter_{step:07d}" / "checksums.json").read_text())["files"]
    assert {n.split("_")[2] for n in files if n.endswith(".distcp")} == {str(r) for r in range(4)}
    for mine, ref in zip(run.train, run_3d.train[:step], strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-6)


def test_checkpoint_resumes_with_fewer_dp_ranks_and_another_pipeline(
    run_3d: Run, stopped: tuple[Run, Path, Signal], datasets: tuple[list[str], Path], tmp_path: Path
) -> None:
    """The checkpoint the SIGTERM left (TP2xPP1xDP2, distributed optimizer, SP), resumed by TP2xPP2xDP1: the
    uninterrupted run's next iterations up to 20 within 1e-4."""
    train_set, _ = datasets
    run, ckpt, _ = stopped
    step = run.train[-1]["iteration"]
    resumed = ok(train(4, ["--load", str(ckpt), *train_set, *RUN_3D], tmp_path / "resumed"))
    assert "world 4 = TP 2 x PP 2 x DP 1" in resumed.stdout
    assert f"resumed from {ckpt} at iteration {step}" in resumed.stdout
    tail = run_3d.train[step:]
    assert [m["iteration"] for m in resumed.train] == list(range(step + 1, 21))
    assert [m["data_digest"] for m in resumed.train] == [m["data_digest"] for m in tail]
    for mine, ref in zip(resumed.train, tail, strict=True):
        assert mine["loss"] == pytest.approx(ref["loss"], rel=1e-4)
