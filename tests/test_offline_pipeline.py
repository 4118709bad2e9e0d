"""End-to-end tests of the offline packing job on a synthetic dataset and a tiny trained BPE."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from mmpack.cli import main as mmpack_main
from mmpack.offline_packing.config import PackJobConfig
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.options import job_config, with_options
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from mmpack.packing.chat import ChatTemplate, normalize_record, render_conversation, tokenize_conversation
from mmpack.packing.image_tokens import ImageTokenRule, read_image_size
from mmpack.packing.tokenizer import load_tokenizer
from tests.support.fixtures_data import (
    dataset_files,
    make_synthetic_dataset,
    read_arrow_bins,
    read_wds_bins,
    train_tiny_bpe,
)

SEQ_LEN = 1024


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("raw")
    data = make_synthetic_dataset(root / "data", n_samples=80, seed=3, size_range=(40, 300), max_words=80)
    return data, train_tiny_bpe(root / "tok")


def _cfg(raw, out: Path, **kw) -> PackJobConfig:
    data, tok = raw
    base = dict(
        inputs=(str(data.jsonl_path),),
        output=str(out),
        seq_len=SEQ_LEN,
        tokenizer=str(tok),
        format="both",
        max_bins_per_shard=5,
        chunk_size=16,
        progress=False,
    )
    base.update(kw)
    return job_config(**base)


@pytest.fixture(scope="module")
def packed(raw, tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("packed") / "out"
    summary = run_pack(_cfg(raw, out))
    return out, summary


def _records_by_id(data) -> dict[str, dict]:
    out = {}
    for line, rec in enumerate(data.records, start=1):
        conv = normalize_record(rec, source=str(data.jsonl_path), line=line)
        out[conv.sample_id] = conv
    return out


def test_accounting_and_manifest(packed, raw) -> None:
    out, summary = packed
    data, _ = raw
    m = read_manifest(str(out))
    c = m["counts"]
    assert c["samples_read"] == data.n_samples == c["samples_packed"] + c["samples_rejected"]
    assert summary.samples_read == c["samples_read"] and summary.samples_packed == c["samples_packed"]
    assert m["formats"] == ["arrow", "wds"] and m["seq_len"] == SEQ_LEN
    arrow = [e for e in m["shards"] if e["format"] == "arrow"]
    wds = [e for e in m["shards"] if e["format"] == "wds"]
    assert [(e["first_bin"], e["bins"]) for e in arrow] == [(e["first_bin"], e["bins"]) for e in wds]
    assert sum(e["bins"] for e in arrow) == c["bins"] and all(e["bins"] <= 5 for e in arrow)
    assert [e["first_bin"] for e in arrow] == list(np.cumsum([0] + [e["bins"] for e in arrow[:-1]]))
    assert sum(e["samples"] for e in arrow) == c["samples_packed"]
    assert sum(e["tokens"] for e in arrow) == c["tokens"]
    for e in m["shards"]:
        blob = (out / e["path"]).read_bytes()
        assert len(blob) == e["bytes"] and hashlib.sha256(blob).hexdigest() == e["sha256"]
    assert not m["tokenizer"]["is_fallback"] and m["tokenizer"]["vocab_size"] == 600
    stats = json.loads((out / "stats.json").read_text())
    assert stats["counts"] == c
    assert 0 < summary.fill_efficiency <= 1
    assert "samples read" in summary.format_table()


def test_stats_json_matches_mmpack_stats(packed, capsys: pytest.CaptureFixture[str]) -> None:
    out, _ = packed
    stored = json.loads((out / "stats.json").read_text())
    capsys.readouterr()
    assert mmpack_main(["stats", "--json", str(out)]) == 0
    live = json.loads(capsys.readouterr().out)
    assert live["source"].pop("path") == str(out)  # stats.json does not name its location
    shared = set(stored) & set(live)
    assert {"fill_efficiency", "num_bins", "num_samples", "length_distribution", "source"} <= shared
    assert {k: stored[k] for k in shared} == {k: live[k] for k in shared}


def test_arrow_and_wds_hold_the_same_bins(packed) -> None:
    out, _ = packed
    m = read_manifest(str(out))
    arrow = [row for e in m["shards"] if e["format"] == "arrow" for row in read_arrow_bins(out / e["path"])]
    wds = [row for e in m["shards"] if e["format"] == "wds" for row in read_wds_bins(out / e["path"])]
    assert len(arrow) == m["counts"]["bins"]
    assert arrow == wds
    assert [r["key"] for r in arrow] == [f"packed-{b:09d}" for b in range(len(arrow))]


def test_bins_hold_exact_samples(packed, raw) -> None:
    """Every stored sample: ids = direct encode of its rendered text, loss mask = assistant tokens,
    images = the original bytes with the right format and grid."""
    out, _ = packed
    data, tok_path = raw
    tok = load_tokenizer(str(tok_path))
    rule = ImageTokenRule()
    convs = _records_by_id(data)
    m = read_manifest(str(out))
    seen = []
    for e in (e for e in m["shards"] if e["format"] == "arrow"):
        for row in read_arrow_bins(out / e["path"]):
            assert sum(row["seq_lens"]) == len(row["input_ids"]) == len(row["loss_mask"]) <= SEQ_LEN
            starts = np.concatenate([[0], np.cumsum(row["seq_lens"])])
            img_pos = 0
            for k, sid in enumerate(row["sample_ids"]):
                conv = convs[sid]
                sizes = [read_image_size(Path(data.image_root) / p) for p in conv.images]
                counts = [rule.num_tokens(h, w) for w, h, _ in sizes]
                ids = row["input_ids"][starts[k] : starts[k + 1]]
                assert ids == tok.encode(render_conversation(conv.messages, counts))
                ref = tokenize_conversation(conv, tok, counts, ChatTemplate())
                assert row["loss_mask"][starts[k] : starts[k + 1]] == ref.loss_mask.tolist()
                for p, (w, h, fmt) in zip(conv.images, sizes):
                    assert row["images"][img_pos] == (Path(data.image_root) / p).read_bytes()
                    assert row["image_formats"][img_pos] == fmt
                    assert row["image_grid_thw"][img_pos] == list(rule.grid_thw(h, w))
                    img_pos += 1
                seen.append(sid)
            assert img_pos == len(row["images"])
            _assert_images_match_pad_runs(row, m)
    assert sorted(seen) == sorted(convs)


def test_workers_and_reruns_are_byte_identical(packed, raw, tmp_path: Path) -> None:
    out, _ = packed
    reference = dataset_files(out)
    two = tmp_path / "w2"
    run_pack(_cfg(raw, two, workers=2))
    assert dataset_files(two) == reference
    again = tmp_path / "w1"
    run_pack(_cfg(raw, again, chunk_size=7, clean_work=True))
    assert dataset_files(again) == reference
    assert not (again / "_work").exists()


def test_resume_skips_complete_stages_and_minus_s_reruns(raw, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _cfg(raw, out)
    first = run_pack(cfg)
    assert set(first.stage_seconds) == {"scan", "lengths", "binpack", "write"}
    files = dataset_files(out)
    again = run_pack(cfg)
    assert again.stages_skipped == ["scan", "lengths", "binpack", "write"] and not again.stage_seconds
    assert again.samples_read == first.samples_read
    rerun = run_pack(with_options(cfg, start_stage=3))
    assert set(rerun.stage_seconds) == {"binpack", "write"}
    assert dataset_files(out) == files
    # a changed packing option reruns binpack and write only
    changed = run_pack(with_options(cfg, max_samples_per_bin=2))
    assert set(changed.stage_seconds) == {"binpack", "write"}
    m = read_manifest(str(out))
    assert all(
        len(r["seq_lens"]) <= 2
        for e in m["shards"]
        if e["format"] == "arrow"
        for r in read_arrow_bins(out / e["path"])
    )
    # -S 3 on a fresh output: stages 1-2 are missing
    with pytest.raises(PackError, match="stage 1"):
        run_pack(_cfg(raw, tmp_path / "fresh", start_stage=3))


def test_single_stage_modules(raw, tmp_path: Path) -> None:
    out = tmp_path / "out"
    cfg = _cfg(raw, out, format="arrow")
    for stage in (1, 2, 3, 4):
        summary = run_pack(with_options(cfg, only_stage=stage))
        assert list(summary.stage_seconds) == [("scan", "lengths", "binpack", "write")[stage - 1]]
    assert read_manifest(str(out))["counts"]["samples_read"] == raw[0].n_samples


def test_mmpack_pack_cli(raw, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, tok = raw
    out = tmp_path / "cli"
    argv = ["pack", "-i", str(data.jsonl_path), "-o", str(out), "-L", "700", "-t", str(tok), "-M", "3"]
    argv += ["-f", "wds", "--max-shard-bytes", "200K", "--no-progress", "-w", "2"]
    assert mmpack_main(argv) == 0
    err = capsys.readouterr().err
    assert "samples read" in err and "fill efficiency" in err
    m = read_manifest(str(out))
    assert m["formats"] == ["wds"] and m["algorithm"]["max_items_per_bin"] == 3
    assert len(m["shards"]) > 1
    assert mmpack_main(["pack", "-i", str(data.jsonl_path), "-o", str(out), "-L", "0", "-t", str(tok)]) == 2
    with pytest.raises(SystemExit):
        mmpack_main(["pack", "--help"])
    assert "--max-images-per-bin" in capsys.readouterr().out


def _assert_images_match_pad_runs(row: dict, manifest: dict) -> None:
    """The i-th image fills the i-th run of <|image_pad|> tokens, with grid_h * grid_w / merge**2 of them."""
    pad = manifest["tokenizer"]["special_ids"]["image_pad"]
    merge = manifest["image_rule"]["merge_size"]
    ids = np.asarray(row["input_ids"])
    is_pad = np.concatenate([[0], (ids == pad).astype(np.int8), [0]])
    starts, ends = np.flatnonzero(np.diff(is_pad) == 1), np.flatnonzero(np.diff(is_pad) == -1)
    assert len(starts) == len(row["images"]) == len(row["image_grid_thw"])
    for (t, gh, gw), a, b in zip(row["image_grid_thw"], starts, ends):
        assert b - a == t * gh * gw // merge**2
    assert not np.asarray(row["loss_mask"])[ids == pad].any()


def test_overlength_policies(raw, tmp_path: Path) -> None:
    seq_len = 200
    drop = run_pack(_cfg(raw, tmp_path / "drop", seq_len=seq_len, overlength="drop"))
    assert drop.rejected_by_reason.get("overlength", 0) > 0
    assert drop.samples_read == drop.samples_packed + drop.samples_rejected
    rejects = [json.loads(x) for x in (tmp_path / "drop" / "rejects.jsonl").read_text().splitlines()]
    assert all(r["line"] >= 1 and r["source"].endswith("data.jsonl") for r in rejects)
    trunc = run_pack(_cfg(raw, tmp_path / "trunc", seq_len=seq_len, overlength="truncate"))
    assert trunc.samples_packed > drop.samples_packed
    assert trunc.samples_read == trunc.samples_packed + trunc.samples_rejected
    m = read_manifest(str(tmp_path / "trunc"))
    for e in m["shards"]:
        if e["format"] == "arrow":
            for row in read_arrow_bins(tmp_path / "trunc" / e["path"]):
                assert sum(row["seq_lens"]) <= seq_len
                _assert_images_match_pad_runs(row, m)

    with pytest.raises(PackError, match="overlength"):
        run_pack(_cfg(raw, tmp_path / "err", seq_len=seq_len, overlength="error"))


def test_max_images_per_bin(raw, tmp_path: Path) -> None:
    out = tmp_path / "img"
    summary = run_pack(_cfg(raw, out, max_images_per_bin=1, format="arrow"))
    multi = sum(1 for rec in raw[0].records if len(normalize_record(rec, source="x", line=1).images) > 1)
    assert multi > 0 and summary.rejected_by_reason == {"too_many_images": multi}
    m = read_manifest(str(out))
    rows = [r for e in m["shards"] for r in read_arrow_bins(out / e["path"])]
    assert all(len(r["images"]) <= 1 for r in rows)
    assert sum(len(r["seq_lens"]) for r in rows) == summary.samples_packed == raw[0].n_samples - multi


def test_config_validation() -> None:
    ok = dict(inputs=("x.jsonl",), output="o", seq_len=8, tokenizer="tok.json")
    with pytest.raises(ValueError, match="no tokenizer"):  # there is no default one
        job_config(**{**ok, "tokenizer": ""})
    with pytest.raises(ValueError, match="exclude each other"):
        job_config(**ok, chat_default_system="Be brief.", chat_no_default_system=True)
    with pytest.raises(ValueError, match="seq_len"):
        job_config(**{**ok, "seq_len": 0})
    with pytest.raises(ValueError, match="energon"):
        job_config(**ok, energon=True)
    with pytest.raises(ValueError, match="prefix"):
        job_config(**ok, shard_prefix="a.b")
    with pytest.raises(ValueError, match="workers"):
        job_config(**ok, workers=0)
