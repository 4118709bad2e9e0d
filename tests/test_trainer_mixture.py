"""The trainer on a mixture: `--data-path 0.7 A 0.3 B` at PP2 x DP2 on CPU (the sources' sums reduced over
the DP ranks and brought from the last stage to the logger) logs each source's loss and tokens (log line,
metrics file, TensorBoard)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from mmpack.trainer.arguments import parse_args
from tests.support.trainer import ok, train

pytestmark = pytest.mark.slow


@pytest.mark.ranks
def test_weighted_data_path_at_pp2_dp2_logs_per_source_loss(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a = packed_dataset(n_samples=60, seed=0)
    b = packed_dataset(n_samples=60, seed=1)
    tb = tmp_path / "tb"
    args = [
        "--data-path", "0.7", str(a), "0.3", str(b), "--pipeline-model-parallel-size", "2",
        "--micro-batch-size", "1", "--global-batch-size", "10", "--train-iters", "2", "--lr", "1e-3",
        "--tensorboard-dir", str(tb),
    ]  # fmt: skip
    run = ok(train(4, args, tmp_path / "run"))
    names = tuple(str(p) for p in (a, b))  # both folders are named "packed": the sources go by their paths
    assert "world 4 = TP 1 x PP 2 x DP 2" in run.stdout
    assert len(run.train) == 2
    for m in run.train:
        assert set(m["source_loss"]) == set(names) and all(
            math.isfinite(v) for v in m["source_loss"].values()
        )
        # every target token is one source's: the sources' tokens add up to the step's, their losses to its loss
        assert sum(m["source_tokens"].values()) == m["target_tokens"]
        total = sum(m["source_loss"][n] * m["source_tokens"][n] for n in names) / m["target_tokens"]
        assert total == pytest.approx(m["loss"], rel=1e-5)
        # 10 bins per step, 7 from a and 3 from b: a holds most of the tokens
        assert m["source_tokens"][names[0]] > m["source_tokens"][names[1]] > 0
    assert f" {names[0]} loss: " in run.stdout and f" {names[1]} loss: " in run.stdout
    events = EventAccumulator(str(tb))
    events.Reload()
    for n in names:
        logged = [(e.step, e.value) for e in events.Scalars(f"lm loss/{n}")]
        assert [s for s, _ in logged] == [1, 2]
        assert [v for _, v in logged] == pytest.approx([m["source_loss"][n] for m in run.train], rel=1e-5)
        assert [e.value for e in events.Scalars(f"tokens/{n}")] == [m["source_tokens"][n] for m in run.train]


def test_data_flags(tmp_path: Path) -> None:
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n  - {path: /d/a, weight: 3, name: ocr}\n  - {path: s3://b/c, weight: 1}\n")
    cfg = parse_args(["--data-mixture", str(mix), "--seq-length", "256"])
    assert cfg.data.data_mixture is not None and cfg.data.data_mixture.sources[0].path == "/d/a"
    assert cfg.data.source_names == ("ocr", "c")
    cfg = parse_args(["--data-path", "0.7", "/d/a", "0.3", "/d/b"])
    assert cfg.data.data_path is None and [s.weight for s in cfg.data.data_mixture.sources] == [0.7, 0.3]
    assert parse_args(["--data-path", "/d/a"]).data.data_path == "/d/a"
    with pytest.raises(ValueError, match="not both"):
        parse_args(["--data-path", "/d/a", "--data-mixture", str(mix)])
    with pytest.raises(ValueError, match="pairs of weight and path"):
        parse_args(["--data-path", "0.7", "/d/a", "/d/b"])
