"""Mixtures: three packed datasets (one on moto S3) blended by weight; shares, purity, resume, bad specs."""

from __future__ import annotations

import json
import os
import re
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


def test_raw_source_in_a_mixture_file_parses_and_is_checked(tmp_path: Path) -> None:
    """A `kind: raw` entry (raw records, packed online) parses with its own keys and round-trips; its keys on a
    packed source, an unknown kind and a bad buffer size are each one line; the loader refuses one not opened."""
    spec = tmp_path / "mix.yaml"
    packed = f"  - {{path: {tmp_path / 'packed'}, weight: 1}}\n"
    spec.write_text(
        f"sources:\n{packed}  - {{path: {tmp_path / 'r.jsonl'}, weight: 1, kind: raw, name: fresh, "
        f"image_root: {tmp_path}, packing_buffer_size: 500}}\n"
    )
    mix = load_mixture_file(str(spec))
    raw = mix.sources[1]
    assert (raw.kind, raw.image_root, raw.packing_buffer_size, mix.raw_sources) == (
        "raw",
        str(tmp_path),
        500,
        ("fresh",),
    )
    (tmp_path / "mix.json").write_text(json.dumps(mix.to_dict()))
    assert load_mixture_file(str(tmp_path / "mix.json")) == mix
    bad = {
        "image_root and packing_buffer_size are keys of a 'kind: raw' source": "image_root: x",
        "kind must be one of ('packed', 'raw')": "kind: shards",
        "packing_buffer_size must be a number of records >= 1": "kind: raw, packing_buffer_size: 0",
    }
    for message, keys in bad.items():
        spec.write_text(f"sources:\n{packed}  - {{path: {tmp_path / 'r.jsonl'}, weight: 1, {keys}}}\n")
        with pytest.raises(
            ValueError, match=re.escape(f"mixture file {spec}: source 1: ") + ".*" + re.escape(message)
        ):
            load_mixture_file(str(spec))
    with pytest.raises(ValueError, match=r"mixture source 'fresh' is raw records \(kind: raw\) not opened"):
        build_loader(
            Mixture(sources=(raw,)),
            topology=Topology(0, 1),
            micro_batch_size=1,
            global_batch_size=1,
            num_workers=0,
        )


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


def _raw_records(packed: Path, buffer_size: int, records: Path | None = None) -> Any:
    """The raw records a `packed_dataset` was packed from (or `records`), as an online source with its options."""
    from mmpack.offline_packing.online import raw_source

    return raw_source(
        str(records or packed.parent / "raw" / "data.jsonl"),
        buffer_size=buffer_size,
        seq_len=256,
        tokenizer=str(packed.parent / "tokenizer" / "tokenizer.json"),
        image_root=str(packed.parent / "raw"),
        seed=8,
    )


def _bin_contents(records: list[dict[str, Any]]) -> list[tuple[int, bytes, tuple[bytes, ...]]]:
    """Each bin as (its sample count, token ids, images), sorted: what a bin holds, not where it is (a sample's
    id names its input file)."""
    return sorted(
        (
            len(r["sample_ids"]),
            np.asarray(r["input_ids"], np.uint32).tobytes(),
            tuple(map(bytes, r["images"])),
        )
        for r in records
    )


def _rows(ld: PackedLoader, micro_batches: int) -> list[tuple[int, int, bytes]]:
    """(source, bin, token row) of every row of the next `micro_batches` micro-batches."""
    out = []
    for _, batch in zip(range(micro_batches), ld):
        assert contract_problems(batch) == [] and batch.bin_ids is not None
        rows = zip(batch.source_ids.tolist(), batch.bin_ids.tolist(), batch.tokens.numpy())
        out += [(s, b, t.tobytes()) for s, b, t in rows]
    ld.close()
    return out


def test_raw_source_mixes_with_a_packed_one(packed_dataset: Any, tmp_path: Path) -> None:
    """A packed dataset and raw records (packed whole, in one buffer) blend by weight: deterministic, an exact
    resume inside a step, the raw source's bins those of the offline job on the same records, its rejects
    counted. Controls: a buffer of half the records packs other bins (and is refused in a mixture)."""
    from tests.support.loader_data import all_records

    packed, other = packed_dataset(n_samples=40, seed=8), packed_dataset(n_samples=60, seed=8)
    lines = (other.parent / "raw" / "data.jsonl").read_text().splitlines(keepends=True)
    with_bad = tmp_path / "with-bad.jsonl"  # the same records and a malformed one among them
    with_bad.write_text("".join(lines[:30]) + '{"conversations": [oops\n' + "".join(lines[30:]))
    source = _raw_records(other, 10_000, with_bad)
    mixture = Mixture(
        sources=(
            MixtureSource(path=str(packed), weight=0.6, name="packed"),
            MixtureSource(path=source.name, weight=0.4, name="fresh", raw=source),
        )
    )
    kw: dict[str, Any] = {
        "topology": Topology(0, 1),
        "micro_batch_size": 2,
        "global_batch_size": 4,
        "seed": 3,
    }
    whole = _rows(build_loader(mixture, num_workers=0, **kw), 40)
    assert whole == _rows(build_loader(mixture, num_workers=2, **kw), 40)  # a pure function, with workers too
    raw_rows = [(b, t) for s, b, t in whole if s == 1]
    assert 0.3 < len(raw_rows) / len(whole) < 0.5
    # the raw source's bins: the offline job's bins of the same records, each row its bin's tokens
    buffer = source.pack_buffer(0)
    assert {b for b, _ in raw_rows} == set(range(buffer.num_bins))  # more than an epoch of it was read
    for b, tokens in raw_rows:
        ids = np.asarray(buffer.record(b)["input_ids"], np.int64)
        assert np.frombuffer(tokens, np.int64)[: len(ids)].tolist() == ids.tolist()
    offline = list(all_records(other).values())
    online = [buffer.record(j) for j in range(buffer.num_bins)]
    assert _bin_contents(online) == _bin_contents(offline)
    # control: a buffer of half the records packs other bins; in a mixture it is refused in one line
    halves = _raw_records(other, 30, with_bad)
    assert _bin_contents(
        [p.record(j) for p in map(halves.pack_buffer, (0, 1)) for j in range(p.num_bins)]
    ) != (_bin_contents(offline))
    with pytest.raises(
        ValueError, match=r"mixture source 'with-bad\.jsonl': a raw source in a mixture is packed in"
    ):
        build_loader([(0.6, str(packed)), (0.4, halves)], num_workers=0, **kw)
    # resume one micro-batch into a step (JSON state round trip) equals the uninterrupted stream
    first = build_loader(mixture, num_workers=0, **kw)
    head = _rows(first, 9)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["sources"][1]["manifest_fingerprint"] == source.fingerprint
    resumed = build_loader(mixture, num_workers=0, **kw)
    resumed.load_state_dict(state)
    assert head + _rows(resumed, 31) == whole
    # the malformed record: skipped, counted once by the loader, written to its rejects file
    rejects = tmp_path / "rejects"
    loader = build_loader(mixture, num_workers=0, rejects_dir=str(rejects), **kw)
    _rows(loader, 2)
    metrics = loader.metrics()
    assert (metrics["raw_samples_read"], metrics["raw_rejected.malformed_json"]) == (61, 1)
    assert metrics["raw_samples_rejected"] == len(buffer.rejects)
    rows = [json.loads(x) for x in (rejects / "rejects-dp0.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["line"]) for r in rows if r["reason"] == "malformed_json"] == [
        ("malformed_json", 31)
    ]
    with pytest.raises(ValueError, match="--split is not supported in a mixture with raw sources"):
        build_loader(mixture, num_workers=0, split=((9.0, 1.0, 0.0), 0, 3), **kw)
