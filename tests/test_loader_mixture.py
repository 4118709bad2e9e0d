"""Mixtures: three packed datasets (one on moto S3) blended by weight; shares, purity, resume, bad specs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mmpack.dataloader import PackedLoader, StreamOrder, Topology, build_loader, load_manifest
from mmpack.dataloader.blend import blend_positions
from mmpack.dataloader.mixture import Mixture, MixtureSource, load_mixture_file, parse_inline
from mmpack.demo.synthetic import build_packed_dataset
from mmpack.packing.batch import contract_problems
from tests.support.storage_servers import S3Endpoint, moto_s3

WEIGHTS = (0.5, 0.3, 0.2)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("mix")
    return [
        str(build_packed_dataset(root / f"d{i}", n_samples=48, seed=i, tokenizer_seed=0, fmt="arrow"))
        for i in range(3)
    ]


@pytest.fixture(scope="module")
def s3(local: list[str]) -> Iterator[tuple[S3Endpoint, str]]:
    with moto_s3() as endpoint:
        yield endpoint, endpoint.upload_folder(local[2], "mix", "d2")


def mixed(paths: list[str], weights: tuple[float, ...], topo: Topology, **kw: Any) -> PackedLoader:
    kw.setdefault("micro_batch_size", 2)
    kw.setdefault("global_batch_size", 8)
    kw.setdefault("num_workers", 0)
    return build_loader(list(zip(weights, paths)), topology=topo, **kw)


def read(ld: PackedLoader, micro_batches: int) -> list[tuple[int, int]]:
    """(source, bin) of every row of the next `micro_batches` micro-batches."""
    it, out = iter(ld), []
    for _ in range(micro_batches):
        batch = next(it)
        assert contract_problems(batch) == []
        out += list(zip(batch.source_ids.tolist(), batch.bin_ids.tolist()))
    ld.close()
    return out


def own_stream(path: str, seed: int, count: int, **options: Any) -> list[int]:
    """The first `count` bins of one dataset's own chained-epoch order (what it alone would give)."""
    return StreamOrder(load_manifest(path, **options), seed).positions(0, count).tolist()


@pytest.mark.slow
def test_three_sources_shares_order_and_purity(local: list[str], s3: tuple[S3Endpoint, str]) -> None:
    endpoint, url = s3
    sources = (
        MixtureSource(path=local[0], weight=0.5, name="a"),
        MixtureSource(path=local[1], weight=0.3, name="b"),
        MixtureSource(path=url, weight=0.2, name="c", storage_options=endpoint.storage_options),
    )
    ld = build_loader(
        Mixture(sources=sources),
        topology=Topology(0, 1),
        micro_batch_size=4,
        global_batch_size=40,
        num_workers=2,
    )
    rows = read(ld, 500)  # 2,000 bins: 50 global batches
    src = np.array([s for s, _ in rows])
    shares = np.bincount(src, minlength=3) / len(src)
    assert np.abs(shares - WEIGHTS).max() <= 0.01, shares
    counts = np.cumsum(np.eye(3)[src], axis=0)  # every window of 1,000 consecutive bins too
    assert np.abs((counts[1000:] - counts[:-1000]) / 1000 - WEIGHTS).max() <= 0.01
    assert src[:40].tolist() != sorted(src[:40].tolist())  # interleaved, not source after source
    # each source in its own order, as alone: every bin once per epoch of that source
    paths = [local[0], local[1], url]
    for k, path in enumerate(paths):
        options = {"storage_options": endpoint.storage_options} if k == 2 else {}
        mine = [b for s, b in rows if s == k]
        assert mine == own_stream(path, 0, len(mine), **options)
    # a pure function: another process works out the same order; another seed gives another
    code = (
        "import json, sys; from mmpack.dataloader.blend import blend_positions; "
        "s, i = blend_positions([0.5, 0.3, 0.2], int(sys.argv[1]), 0, 2000); print(json.dumps(s.tolist()))"
    )
    other = [json.loads(subprocess.check_output([sys.executable, "-c", code, str(seed)])) for seed in (0, 1)]
    assert other[0] == src.tolist()
    assert other[1] != other[0]
    # over every window of 1,000 consecutive global batches (40 bins each): the pure order, 80,000 bins
    far, _ = blend_positions(WEIGHTS, 0, 0, 80_000)
    counts = np.concatenate([np.zeros((1, 3)), np.cumsum(np.eye(3)[far], axis=0)])
    window = 40_000
    assert np.abs((counts[window:] - counts[:-window]) / window - WEIGHTS).max() <= 0.01


def test_resume_inside_an_epoch_and_inside_a_step(local: list[str]) -> None:
    topo = Topology(0, 1)
    full = read(mixed(local, WEIGHTS, topo), 4 * 8)  # 8 steps; an epoch of the mixture is 40 bins (5 steps)
    ld = mixed(local, WEIGHTS, topo)
    first = read(ld, 4 * 2 + 1)  # 2 steps and one micro-batch: inside epoch 0 and inside step 2
    state = ld.state_dict()
    assert state["epoch"] == 0 and state["micro_batches_in_step"] == 1
    resumed = mixed(local, WEIGHTS, topo)
    resumed.load_state_dict(state)
    assert first + read(resumed, 4 * 8 - 9) == full


def test_dp2_to_dp4_resume_exact(local: list[str]) -> None:
    def global_batches(loaders: list[PackedLoader], steps: int) -> list[list[tuple[int, int]]]:
        per_rank = [read(ld, steps * ld.micro_batches_per_step) for ld in loaders]
        size = len(per_rank[0]) // steps
        return [[row for rank in per_rank for row in rank[s * size : (s + 1) * size]] for s in range(steps)]

    full = global_batches([mixed(local, WEIGHTS, Topology(r, 2), global_batch_size=16) for r in range(2)], 6)
    two = [mixed(local, WEIGHTS, Topology(r, 2), global_batch_size=16) for r in range(2)]
    before = global_batches(two, 3)
    state = two[0].state_dict()
    four = [mixed(local, WEIGHTS, Topology(r, 4), global_batch_size=16) for r in range(4)]
    for ld in four:
        ld.load_state_dict(state)
    assert before + global_batches(four, 3) == full


def test_resume_with_new_weights_continues_every_source(local: list[str]) -> None:
    topo = Topology(0, 1)
    ld = mixed(local, WEIGHTS, topo)
    stage1 = read(ld, 4 * 10)  # 80 bins
    state = ld.state_dict()
    new = (0.2, 0.3, 0.5)
    stage2_loader = mixed(local, new, topo)
    stage2_loader.load_state_dict(state)
    stage2 = read(stage2_loader, 4 * 20)  # 160 bins
    shares = np.bincount([s for s, _ in stage2], minlength=3) / len(stage2)
    assert np.abs(shares - new).max() <= 0.02, shares  # 160 bins: off by at most ~3 bins per source
    for k, path in enumerate(local):
        seen = [b for s, b in stage1 + stage2 if s == k]
        assert seen == own_stream(path, 0, len(seen))  # continues where it stopped, nothing skipped
        n = load_manifest(path).num_bins
        for e in range(len(seen) // n):  # every bin once per epoch of the source
            assert sorted(seen[e * n : (e + 1) * n]) == list(range(n))
    # the state of the new stage resumes exactly again (its blend stage is kept)
    state2 = stage2_loader.state_dict()
    assert state2["blend_stage"]["origin"] == 80
    again = mixed(local, new, topo)
    again.load_state_dict(state2)
    cont = mixed(local, new, topo)
    cont.load_state_dict(state)
    assert read(again, 8) == read(cont, 4 * 20 + 8)[-16:]
    with pytest.raises(ValueError, match="partly consumed step"):  # a new mixture only between steps
        partial = mixed(local, WEIGHTS, topo)
        read(partial, 1)
        mixed(local, new, topo).load_state_dict(partial.state_dict())


def test_one_dataset_stream_and_old_state(local: list[str]) -> None:
    topo = Topology(0, 1)
    ld = build_loader(local[0], topology=topo, micro_batch_size=2, global_batch_size=4, num_workers=0)
    rows = read(ld, 6)
    assert {s for s, _ in rows} == {0} and [b for _, b in rows] == own_stream(local[0], 0, 12)
    state = ld.state_dict()
    old = {k: v for k, v in state.items() if k not in ("sources", "blend_stage", "source_positions")}
    old["version"] = 1
    again = build_loader(local[0], topology=topo, micro_batch_size=2, global_batch_size=4, num_workers=0)
    again.load_state_dict(old)
    assert read(again, 2) == list(zip([0] * 4, own_stream(local[0], 0, 16)[12:]))
    # a one-dataset state continues as the first stage of a mixture
    mix = mixed(local, WEIGHTS, topo, global_batch_size=4)
    mix.load_state_dict(old)
    assert mix.state_dict()["source_positions"] == [12, 0, 0]
    nxt = [b for s, b in read(mix, 10) if s == 0]
    assert nxt == own_stream(local[0], 0, 12 + len(nxt))[12:]


def test_compute_balance_and_repeat(local: list[str]) -> None:
    topo = Topology(0, 1)
    plain = read(mixed(local, WEIGHTS, topo), 8)
    balanced = read(mixed(local, WEIGHTS, topo, balance="compute"), 8)
    for s in range(2):  # the same bins in each global batch, laid out by cost
        assert sorted(plain[s * 8 : (s + 1) * 8]) == sorted(balanced[s * 8 : (s + 1) * 8])
    sizes = [load_manifest(p).num_bins for p in local]
    by_repeat = Mixture(sources=tuple(MixtureSource(path=p, repeat=r) for p, r in zip(local, (2, 1, 1))))
    assert by_repeat.epoch_bins(sizes) == 2 * sizes[0] + sizes[1] + sizes[2]
    assert by_repeat.shares(sizes)[0] == pytest.approx(2 * sizes[0] / by_repeat.epoch_bins(sizes))


def test_spec_forms(local: list[str], tmp_path: Path) -> None:
    inline = parse_inline(f"0.7 {local[0]} 0.3 {local[1]}")
    assert [(s.weight, s.path) for s in inline.sources] == [(0.7, local[0]), (0.3, local[1])]
    yaml_file = tmp_path / "mix.yaml"
    yaml_file.write_text(
        f"sources:\n  - {{path: {local[0]}, weight: 2, name: x}}\n  - {{path: {local[1]}, weight: 1}}\n"
    )
    mix = load_mixture_file(str(yaml_file))
    assert mix.names == ("x", "packed") and mix.shares([1, 1]) == pytest.approx((2 / 3, 1 / 3))
    json_file = tmp_path / "mix.json"
    json_file.write_text(json.dumps(mix.to_dict()))
    assert load_mixture_file(str(json_file)) == mix


def test_raw_source_in_a_mixture_file_is_refused_in_one_line(tmp_path: Path) -> None:
    """A `kind: raw` entry names what is missing and what to do; control: the same file without it loads."""
    spec = tmp_path / "mix.yaml"
    entries = (
        f"  - {{path: {tmp_path / 'packed'}, weight: 1}}\n  - {{path: {tmp_path / 'records.jsonl'}, weight: 1"
    )
    spec.write_text(f"sources:\n{entries}, kind: raw}}\n")
    with pytest.raises(
        ValueError, match=r"source 1 is 'kind: raw': raw records are not mixed yet .*mmpack pack"
    ):
        load_mixture_file(str(spec))
    spec.write_text(f"sources:\n{entries}}}\n")
    assert len(load_mixture_file(str(spec)).sources) == 2


def _zero_bins(src: str, dst: Path) -> str:
    shutil.copytree(src, dst)
    raw = json.loads((dst / "manifest.json").read_text())
    raw["shards"], raw["counts"]["bins"] = [], 0
    (dst / "manifest.json").write_text(json.dumps(raw))
    return str(dst)


def test_bad_specs_each_one_clear_error(local: list[str], tmp_path: Path) -> None:
    topo = Topology(0, 1)
    with pytest.raises(ValueError, match="weight must be a positive number"):
        parse_inline(f"0 {local[0]} 1 {local[1]}")
    with pytest.raises(ValueError, match="weight must be a positive number"):
        mixed(local[:2], (-1.0, 1.0), topo)
    with pytest.raises(ValueError, match="pairs of weight and path"):
        parse_inline(f"0.3 {local[0]} 0.7")
    with pytest.raises(ValueError, match="'x' is not a weight"):
        parse_inline(f"x {local[0]}")
    with pytest.raises(FileNotFoundError, match=r"mixture source 'nowhere' .*no packed dataset"):
        mixed([local[0], str(tmp_path / "nowhere")], (0.5, 0.5), topo)
    link = tmp_path / "same"
    os.symlink(local[0], link)
    with pytest.raises(ValueError, match="names one dataset twice"):
        mixed([local[0], str(link)], (0.5, 0.5), topo)
    with pytest.raises(ValueError, match="every source a weight or every source a repeat"):
        Mixture(sources=(MixtureSource(path=local[0], weight=1), MixtureSource(path=local[1], repeat=1)))
    empty = _zero_bins(local[1], tmp_path / "empty")
    with pytest.raises(ValueError, match="mixture source 'empty' has no bins"):
        mixed([local[0], empty], (0.5, 0.5), topo)
    short = str(
        build_packed_dataset(tmp_path / "short", n_samples=16, seq_len=256, tokenizer_seed=0, fmt="arrow")
    )
    os.rename(short, tmp_path / "short256")
    with pytest.raises(
        ValueError, match=r"mixture sources 'packed' and 'short256' differ in seq_len \(384 vs 256\)"
    ):
        mixed([local[0], str(tmp_path / "short256")], (0.5, 0.5), topo)
    other = str(build_packed_dataset(tmp_path / "other", n_samples=16, seed=0, tokenizer_seed=1, fmt="arrow"))
    with pytest.raises(ValueError, match=r"other/packed' were packed with different tokenizers \(sha256"):
        mixed([local[0], other], (0.5, 0.5), topo)
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"sources:\n  - {{path: {local[0]}, weigth: 1}}\n")
    with pytest.raises(ValueError, match="source 0 must be a mapping"):
        load_mixture_file(str(bad))


def test_stats_of_a_mixture(local: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from mmpack.cli import main

    one = [json.loads(_stats(main, capsys, p, "--json")) for p in local[:2]]
    report = json.loads(_stats(main, capsys, "--mixture", f"3 {local[0]} 1 {local[1]}", "--json"))
    assert [s["share"] for s in report["sources"]] == pytest.approx([0.75, 0.25])
    assert [s["report"]["num_bins"] for s in report["sources"]] == [r["num_bins"] for r in one]
    fills = [r["fill_efficiency"] for r in one]
    assert report["blended"]["fill_efficiency"] == pytest.approx(0.75 * fills[0] + 0.25 * fills[1])
    assert sum(report["blended"]["token_share"].values()) == pytest.approx(1.0)
    text = _stats(main, capsys, "--mixture", f"3 {local[0]} 1 {local[1]}")
    assert "blended stream" in text and local[1] in text
    assert main(["stats", "--mixture", f"0 {local[0]} 1 {local[1]}"]) == 1
    assert "weight must be a positive number" in capsys.readouterr().err


def _stats(main: Any, capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(["stats", *args]) == 0
    return capsys.readouterr().out


def test_split_of_a_mixture_splits_every_source(local: list[str]) -> None:
    """--split over a mixture: each source is split by its own bin count; the train part reads only its
    sources' train bins, the valid part only their valid bins, both from every source."""
    from mmpack.dataloader.order import split_bins

    weights, seed = (8.0, 2.0, 0.0), 1234
    parts = {}
    for part in (0, 1):
        rows = read(mixed(local, WEIGHTS, Topology(0, 1), split=(weights, part, seed)), 40)
        parts[part] = {(s, b) for s, b in rows}
        for source, path in enumerate(local):
            own = set(split_bins(load_manifest(path).num_bins, weights, seed=seed)[part].tolist())
            mine = {b for s, b in parts[part] if s == source}
            assert mine and mine <= own, (part, source)
    assert not parts[0] & parts[1]  # control: no bin of a source in both parts
    whole = {(s, b) for s, b in read(mixed(local, WEIGHTS, Topology(0, 1)), 40)}
    assert whole - parts[0]  # without the split the train part's complement is read too
