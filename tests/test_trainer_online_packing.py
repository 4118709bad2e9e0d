"""The trainer on raw records (`--online-packing`): its flags and refusals, the data it reads, and a TP2 x PP2 x
DP2 run from raw records that logs the losses of a DP2 run from the offline job's shards of those records, a
malformed record on the way skipped, counted, written and totalled."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from mmpack.dataloader import load_manifest
from mmpack.trainer.arguments import parse_args
from mmpack.trainer.data import dataset_info, open_raw_data
from tests.support.trainer import ok, train

SEQ = "256"


def _raw_files(packed: Path) -> tuple[Path, Path, Path]:
    """(records, image root, tokenizer folder) a `packed_dataset` was packed from."""
    return packed.parent / "raw" / "data.jsonl", packed.parent / "raw", packed.parent / "tokenizer"


def test_online_packing_flags_and_refusals(tmp_path: Path) -> None:
    cfg = parse_args(
        ["--online-packing", "--data-path", "a.jsonl", "b/*.parquet", "--tokenizer-model", "tok",
         "--seq-length", SEQ, "--image-root", "img", "--packing-buffer-size", "500"]
    )  # fmt: skip
    d = cfg.data
    assert (d.raw_inputs, d.data_path, d.data_mixture) == (("a.jsonl", "b/*.parquet"), None, None)
    assert (d.image_root, d.packing_buffer_size, d.tokenizer_model) == ("img", 500, "tok")
    online = ["--online-packing", "--data-path", "a.jsonl", "--seq-length", SEQ]
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n  - {path: /d/a, weight: 1}\n")
    raw_mix = tmp_path / "raw-mix.yaml"
    raw_mix.write_text(
        "sources:\n  - {path: /d/a, weight: 1}\n  - {path: r.jsonl, kind: raw, weight: 1, name: r}\n"
    )
    split = parse_args([*online, "--tokenizer-model", "t", "--split", "9,1,0"])  # the records are divided
    assert split.data.split == (9.0, 1.0, 0.0)
    refused = {
        "give --hf-model (its folder) or, for a random model, --tokenizer-model DIR": online,
        ", not both": [*online, "--hf-model", "m", "--tokenizer-model", "t"],
        "packs bins of --seq-length tokens": ["--online-packing", "--data-path", "a", "--tokenizer-model", "t"],
        "--packing-buffer-size must be a number of records >= 1": [
            *online, "--tokenizer-model", "t", "--packing-buffer-size", "0"
        ],
        "not with a packed dataset, a mixture of packed datasets only or --mock-data": [
            "--online-packing", "--data-mixture", str(mix), "--tokenizer-model", "t", "--seq-length", SEQ
        ],
        "reads the raw records --data-path names": ["--online-packing", "--tokenizer-model", "t", "--seq-length", SEQ],
        "kind: raw sources: not with": ["--online-packing", "--mock-data"],
        "mixture source 'r' is raw records (kind: raw): add --online-packing": ["--data-mixture", str(raw_mix)],
        "--image-root is an option of --online-packing": ["--data-path", "/d/a", "--image-root", "img"],
        "--tokenizer-model is an option of --online-packing": ["--mock-data", "--tokenizer-model", "t"],
    }  # fmt: skip
    for message, argv in refused.items():
        with pytest.raises(ValueError, match=re.escape(message)):
            parse_args(argv)


def test_raw_data_reads_as_the_offline_dataset(packed_dataset: Callable[..., Path], tmp_path: Path) -> None:
    """The trainer's raw source has the packed dataset's vocabulary, ids and geometry; a missing input is one
    line."""
    packed = packed_dataset(n_samples=60, seed=8)
    records, images, tokenizer = _raw_files(packed)
    argv = ["--online-packing", "--data-path", str(records), "--image-root", str(images)]
    cfg = parse_args([*argv, "--tokenizer-model", str(tokenizer), "--seq-length", SEQ])
    source = open_raw_data(cfg)
    assert dataset_info(source, int(SEQ)) == dataset_info(str(packed), int(SEQ))
    missing = parse_args(["--online-packing", "--data-path", str(tmp_path / "none.jsonl"), "--tokenizer-model",
                          str(tokenizer), "--seq-length", SEQ])  # fmt: skip
    with pytest.raises(ValueError, match=r"--online-packing --data-path .*none\.jsonl"):
        open_raw_data(missing)


@pytest.mark.slow
@pytest.mark.ranks
def test_training_from_raw_records_logs_the_offline_losses(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    """A TP2 x PP2 x DP2 run (8 ranks, sequence parallel, distributed optimizer) from the raw records with a
    buffer that holds them all logs, step for step, the loss of the DP2 run from the offline job's shards of the
    same records (1e-6 relative, as test_trainer_parallel.py compares its TP2 x PP2 x DP2 and TP2 x PP1 x DP2
    runs): each step is one global batch of every bin (the two loaders order bins differently; with one bin per
    micro-batch a step's loss and gradient do not depend on the order). A malformed record in the middle is
    skipped, counted in the log line and metrics, written per DP rank and totalled at the end. Control: a DP2
    run with a buffer of 20 records packs other bins, and the losses differ."""
    packed = packed_dataset(n_samples=40, seed=8)
    records, images, tokenizer = _raw_files(packed)
    bins = load_manifest(str(packed)).num_bins
    assert bins % 2 == 0, f"{bins} bins: a global batch of all of them must divide over DP2"
    lines = records.read_text().splitlines(keepends=True)
    with_bad = tmp_path / "with-bad.jsonl"
    with_bad.write_text("".join(lines[:20]) + '{"conversations": [oops\n' + "".join(lines[20:]))
    common = ["--seq-length", SEQ, "--micro-batch-size", "1", "--global-batch-size", str(bins),
              "--train-iters", "2", "--lr", "1e-3"]  # fmt: skip
    raw = ["--online-packing", "--data-path", str(with_bad), "--image-root", str(images),
           "--tokenizer-model", str(tokenizer), *common]  # fmt: skip
    offline = ok(train(2, ["--data-path", str(packed), *common], tmp_path / "offline"))
    layout = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
              "--use-distributed-optimizer"]  # fmt: skip
    online = ok(train(8, [*raw, *layout, "--packing-buffer-size", "10000"], tmp_path / "online"))
    assert "world 8 = TP 2 x PP 2 x DP 2" in online.stdout and "--online-packing" in online.stdout
    assert len(online.train) == 2
    # the same bins in each step (the token checksums add up per bin) and the same losses
    assert [m["data_digest"] for m in online.train] == [m["data_digest"] for m in offline.train]
    assert [m["target_tokens"] for m in online.train] == [m["target_tokens"] for m in offline.train]
    assert online.losses() == pytest.approx(offline.losses(), rel=1e-6)
    # the malformed record: skipped, counted, written by each DP rank's loader, totalled at the end
    assert [m["raw_rejected"] for m in online.train] == [1, 1]
    assert all(m["raw_samples_read"] == 41 for m in online.train)
    assert " rejected records: 1 |" in online.stdout
    assert "online packing: 41 records read, 1 rejected (malformed_json: 1)" in online.stdout
    for dp in (0, 1):
        rows = [
            json.loads(x) for x in (tmp_path / "online" / f"rejects-dp{dp}.jsonl").read_text().splitlines()
        ]
        assert [(r["reason"], Path(r["source"]).name, r["line"]) for r in rows] == [("malformed_json", "with-bad.jsonl", 21)]  # fmt: skip
    # control: a buffer of 20 records packs other bins, and the same comparison fails
    control = ok(train(2, [*raw, "--packing-buffer-size", "20"], tmp_path / "control"))
    assert [m["data_digest"] for m in control.train] != [m["data_digest"] for m in offline.train]
    assert control.losses() != pytest.approx(offline.losses(), rel=1e-6)


@pytest.mark.slow
@pytest.mark.ranks
def test_split_with_online_packing_trains_on_one_part_and_evaluates_the_other(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    """`--split 90,10,0 --online-packing`: training packs and reads the train part's records, --eval-interval
    the valid part's (`test_online_packing.py` shows the parts disjoint and complete); the eval loss is a finite
    number of other batches than the training steps'."""
    packed = packed_dataset(n_samples=40, seed=8)
    records, images, tokenizer = _raw_files(packed)
    run = ok(
        train(
            1,
            ["--online-packing", "--data-path", str(records), "--image-root", str(images), "--tokenizer-model",
             str(tokenizer), "--seq-length", SEQ, "--micro-batch-size", "1", "--global-batch-size", "2",
             "--train-iters", "2", "--lr", "1e-3", "--split", "90,10,0", "--eval-interval", "2", "--eval-iters",
             "1", "--packing-buffer-size", "20"],
            tmp_path / "run",
        )
    )  # fmt: skip
    assert len(run.train) == 2 and len(run.evals) == 1
    loss = run.evals[0]["eval_loss"]
    assert loss == loss and 0 < loss < 100 and loss not in run.losses()


@pytest.mark.slow
@pytest.mark.ranks
def test_mixture_of_raw_and_packed_sources_logs_each_sources_loss(
    tmp_path: Path, packed_dataset: Callable[..., Path]
) -> None:
    """`--online-packing --data-mixture` with a packed dataset and a `kind: raw` source (packed whole, in one
    buffer, with --tokenizer-model's tokenizer): 2 steps log each source's loss by its name, the step's tokens
    are the sources' tokens, and the raw source's rejects (a malformed record among them) are counted and
    totalled."""
    packed, other = packed_dataset(n_samples=40, seed=8), packed_dataset(n_samples=60, seed=8)
    records, images, tokenizer = _raw_files(other)
    lines = records.read_text().splitlines(keepends=True)
    with_bad = tmp_path / "with-bad.jsonl"
    with_bad.write_text("".join(lines[:30]) + '{"conversations": [oops\n' + "".join(lines[30:]))
    mix = tmp_path / "mix.yaml"
    mix.write_text(
        f"sources:\n  - {{path: {packed}, weight: 0.5, name: packed}}\n"
        f"  - {{path: {with_bad}, kind: raw, weight: 0.5, name: fresh, image_root: {images}}}\n"
    )
    run = ok(
        train(
            1,
            ["--online-packing", "--data-mixture", str(mix), "--tokenizer-model", str(tokenizer), "--seq-length",
             SEQ, "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3"],
            tmp_path / "run",
        )
    )  # fmt: skip
    assert len(run.train) == 2
    for m in run.train:
        assert set(m["source_loss"]) <= {"packed", "fresh"}
        assert sum(m["source_tokens"].values()) == m["target_tokens"]
    assert {n for m in run.train for n, t in m["source_tokens"].items() if t} == {"packed", "fresh"}
    assert " fresh loss: " in run.stdout and " rejected records: 2 |" in run.stdout  # and an overlength one
    assert "online packing: 61 records read, 2 rejected (malformed_json: 1, overlength: 1)" in run.stdout


def test_default_packing_cache_is_the_runs_or_the_users(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without --packing-cache: the local --save folder's packing-cache, else the user's cache (MMPACK_CACHE,
    else XDG_CACHE_HOME, else ~/.cache), never a folder of the system's temp dir that other users write."""
    from mmpack.trainer.data import default_packing_cache

    monkeypatch.setenv("MMPACK_CACHE", str(tmp_path / "mm"))
    assert default_packing_cache(str(tmp_path / "run")) == str(tmp_path / "run" / "packing-cache")
    assert default_packing_cache("s3://bucket/run") == str(tmp_path / "mm" / "packing")
    assert default_packing_cache(None) == str(tmp_path / "mm" / "packing")
    monkeypatch.delenv("MMPACK_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_packing_cache(None) == str(tmp_path / "xdg" / "mmpack" / "packing")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_packing_cache(None) == str(tmp_path / "home" / ".cache" / "mmpack" / "packing")
