"""Reruns of the offline job never reuse stale work: a rerun into a used output folder equals a clean run into an
empty one, byte for byte, after an input, an option or the output naming changed; and only files the job
wrote itself are ever removed."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import fields
from pathlib import Path

import pytest

from mmpack.offline_packing.config import (
    INPUT_FIELDS,
    RUN_CONTROL_FIELDS,
    STAGE_CONFIGS,
    PackJobConfig,
)
from mmpack.offline_packing.options import job_config, with_options
from mmpack.offline_packing.pipeline import run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_data import dataset_files, make_synthetic_dataset, train_tiny_bpe


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_bpe(tmp_path_factory.mktemp("tok"))


def _data(root: Path, seed: int = 2):
    return make_synthetic_dataset(root, n_samples=30, seed=seed, size_range=(30, 120), max_words=40)


def _cfg(inputs: list[Path | str], image_root: Path, out: Path, tok: Path, **kw) -> PackJobConfig:
    opts: dict = dict(seq_len=512, format="arrow", max_bins_per_shard=3, chunk_size=8, progress=False)
    opts.update(kw)
    return job_config(
        inputs=tuple(str(p) for p in inputs),
        image_root=str(image_root),
        output=str(out),
        tokenizer=str(tok),
        **opts,
    )


def _clean_run(cfg: PackJobConfig, tmp: Path) -> dict[str, bytes]:
    """The files of a run of `cfg` into an empty folder (its work folder elsewhere)."""
    out = tmp / "clean"
    shutil.rmtree(out, ignore_errors=True)
    run_pack(with_options(cfg, output=str(out), work_dir=str(tmp / "clean_work")))
    files = dataset_files(out)
    shutil.rmtree(out)
    shutil.rmtree(tmp / "clean_work")
    return files


def test_edited_input_is_packed_again(tmp_path: Path, tok: Path) -> None:
    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok)
    first = run_pack(cfg)
    lines = data.jsonl_path.read_text().splitlines(keepends=True)
    data.jsonl_path.write_text("".join(lines[:12]))  # edit: keep 12 records
    rerun = run_pack(cfg)
    assert rerun.stages_skipped == []  # the scan saw the change, so every stage was redone
    assert rerun.samples_read == 12 != first.samples_read
    assert dataset_files(out) == _clean_run(cfg, tmp_path)


def test_edited_image_is_read_again(tmp_path: Path, tok: Path) -> None:
    from PIL import Image

    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok)
    run_pack(cfg)
    used = next(r.get("image", r.get("images")) for r in data.records if r.get("image", r.get("images")))
    image = data.image_root / (used if isinstance(used, str) else used[0])
    Image.new("RGB", (200, 90), (9, 9, 9)).save(image, format="PNG" if image.suffix == ".png" else "JPEG")
    rerun = run_pack(cfg)
    assert rerun.stages_skipped == []
    assert dataset_files(out) == _clean_run(cfg, tmp_path)


@pytest.mark.parametrize(
    "change",
    [
        {"seq_len": 384},  # -L
        {"max_bins_per_shard": 2},  # cuts the shards differently (read by binpack)
        {"format": "wds"},  # -f: the .arrow shards must go
        {"shard_prefix": "other"},  # another prefix: the old shards must go
        {"format": "both", "energon": True},
    ],
    ids=["seq_len", "bins_per_shard", "format", "prefix", "energon"],
)
def test_rerun_with_other_options_equals_a_clean_run(tmp_path: Path, tok: Path, change: dict) -> None:
    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    run_pack(_cfg([data.jsonl_path], data.image_root, out, tok))
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok, **change)
    run_pack(cfg)
    assert dataset_files(out) == _clean_run(cfg, tmp_path)


def test_energon_metadata_of_an_earlier_run_is_removed(tmp_path: Path, tok: Path) -> None:
    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    run_pack(_cfg([data.jsonl_path], data.image_root, out, tok, format="wds", energon=True))
    assert (out / ".nv-meta").is_dir()
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok, format="wds")
    run_pack(cfg)
    assert dataset_files(out) == _clean_run(cfg, tmp_path)


def test_unchanged_rerun_skips_every_stage(tmp_path: Path, tok: Path) -> None:
    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok)
    run_pack(cfg)
    before = dataset_files(out)
    os.utime(data.jsonl_path)  # touched: the default identity (mtime) sees it, the content hash does not
    rerun = run_pack(cfg)
    assert rerun.stages_skipped == [], "a touched input must be rescanned under --verify-inputs stat"
    again = run_pack(cfg)
    assert again.stages_skipped == ["scan", "lengths", "binpack", "write"] and not again.stage_seconds
    assert dataset_files(out) == before
    hashed = with_options(cfg, verify_inputs="sha256")
    run_pack(hashed)
    os.utime(data.jsonl_path, ns=(1, 1))
    assert run_pack(hashed).stages_skipped == ["scan", "lengths", "binpack", "write"]


def test_foreign_files_are_never_removed(tmp_path: Path, tok: Path) -> None:
    """Files the job did not write stay, even when named like its shards: the folder is refused unless adopted
    with --overwrite, and then only the files the job writes are replaced."""
    from mmpack.packing.ownership import FolderNotOwned

    data = _data(tmp_path / "raw")
    out = tmp_path / "out"
    (out / "shards").mkdir(parents=True)
    foreign = {
        out / "shards" / "packed-000099.arrow": b"user data named like a shard",
        out / "shards" / "notes.txt": b"mine",
        out / "README": b"mine too",
    }
    for p, b in foreign.items():
        p.write_bytes(b)
    with pytest.raises(FolderNotOwned, match="--overwrite"):
        run_pack(_cfg([data.jsonl_path], data.image_root, out, tok))
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} == {
        "shards/packed-000099.arrow",
        "shards/notes.txt",
        "README",
    }
    run_pack(_cfg([data.jsonl_path], data.image_root, out, tok, overwrite=True))
    run_pack(_cfg([data.jsonl_path], data.image_root, out, tok, shard_prefix="next", seq_len=300))
    for p, b in foreign.items():
        assert p.read_bytes() == b
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {e["path"] for e in manifest["shards"]}
    assert all(p.startswith("shards/next-") for p in listed)
    on_disk = {f"shards/{p.name}" for p in (out / "shards").iterdir()}
    assert on_disk == listed | {"shards/packed-000099.arrow", "shards/notes.txt"}


def test_killed_write_then_changed_prefix_leaves_no_orphan(tmp_path: Path, tok: Path, monkeypatch) -> None:
    """Shards of a write stage killed before its manifest are recorded, so the next run still removes them."""
    import mmpack.offline_packing.finalize as finalize_module

    data = _data(tmp_path / "raw")
    out = tmp_path / "out"

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(finalize_module, "build_manifest", killed)
        with pytest.raises(KeyboardInterrupt):
            run_pack(_cfg([data.jsonl_path], data.image_root, out, tok))
    assert any((out / "shards").glob("packed-*.arrow")) and not (out / "manifest.json").exists()
    cfg = _cfg([data.jsonl_path], data.image_root, out, tok, shard_prefix="fresh")
    run_pack(cfg)
    assert dataset_files(out) == _clean_run(cfg, tmp_path)


def test_same_file_by_relative_and_absolute_path_is_read_once(tmp_path: Path, tok: Path, monkeypatch) -> None:
    data = _data(tmp_path / "raw")
    monkeypatch.chdir(data.jsonl_path.parent)
    link = tmp_path / "link.jsonl"
    link.symlink_to(data.jsonl_path)
    cfg = _cfg(
        [data.jsonl_path.name, data.jsonl_path, link, data.jsonl_path.parent],
        data.image_root,
        tmp_path / "o",
        tok,
    )
    summary = run_pack(cfg)
    assert summary.samples_read == data.n_samples == 30


def test_every_job_option_is_in_a_stage_config_or_declared_run_control() -> None:
    """A new option cannot be forgotten by the fingerprints: it must belong to a stage config (hashed whole)
    or be declared as changing no output byte."""
    in_stages = {f.name for cls in STAGE_CONFIGS.values() for f in fields(cls)}
    job = {f.name for f in fields(PackJobConfig)}
    assert job == in_stages | INPUT_FIELDS | RUN_CONTROL_FIELDS
    assert not (in_stages & RUN_CONTROL_FIELDS)
    cfg = job_config(inputs=("x",), output="o", seq_len=8, tokenizer=BYTE_TOKENIZER)
    for name, cls in STAGE_CONFIGS.items():
        assert isinstance(cfg.stage_config(name), cls)


def test_stage_modules_do_not_import_the_cli() -> None:
    root = Path(__file__).resolve().parents[1] / "offline_packing"
    for stage in ("scan", "lengths", "binpack", "write", "pipeline", "finalize"):
        text = (root / f"{stage}.py").read_text()
        assert "pack_cli" not in text and "mmpack.cli" not in text, stage


def _changed(name: str, value: object) -> object:
    """A valid value of option `name` other than `value` (its default)."""
    special: dict[str, object] = {
        "tokenizer": "other.json",
        "output": "other_out",
        "algorithm": "ffd",
        "shard_prefix": "other",
        "format": "wds",
        "overlength": "truncate",
        "verify_inputs": "sha256",
        "image_check": "decode",
        "video_check": "decode",
        "codec_grouping": "fixed",
        "engine": "ray",
        "ray_address": "host:6379",
        "image_mean": (0.5, 0.5, 0.5),
        "image_std": (0.5, 0.5, 0.5),
        "temporal_patch_size": 1,
        "video_frame_factor": 4,
        "video_style": "qwen3_vl",
        "image_style": "gemma4",
        "resample": 2,
        "chat_source": "{{ messages }}",
        "chat_variables": (("bos_token", "<s>"),),
        "storage_options": {"anon": True},
        "video_min_frames": 2,
        "start_stage": 2,
        "only_stage": 2,
    }
    if name in special:
        return special[name]
    if isinstance(value, bool):
        return not value
    if value is None:
        return "/images" if name in ("image_root", "work_dir", "chat_default_system") else 1
    if isinstance(value, (int, float)):
        return value * 2 if value else 1
    if isinstance(value, str):
        return value + "x"
    raise AssertionError(f"no other value for option {name} = {value!r}")


def test_every_option_changes_a_fingerprint_or_is_run_control() -> None:
    """Set each packing option (each flag, each field of the image and video rules and the chat template) to
    another value: some stage's fingerprint changes, unless the option is run control, which changes none."""
    from mmpack.offline_packing.options import job_options, option_fields

    base = job_config(inputs=("x.jsonl",), output="o", seq_len=64, tokenizer=BYTE_TOKENIZER, format="both")

    def prints(cfg: PackJobConfig) -> list[str]:
        from mmpack.offline_packing.fingerprint import stage_fingerprint

        return [stage_fingerprint(s, cfg.stage_config(s), "") for s in STAGE_CONFIGS]

    before = prints(base)
    names = sorted(option_fields())
    assert {"seq_len", "seed", "patch_size", "video_fps", "chat_default_system", "workers"} <= set(names)
    for name in names:
        if name == "inputs":  # enters by identity (path, size, mtime), see test_edited_input_is_packed_again
            continue
        section = option_fields()[name][0]
        default = job_options(base)[name]
        changed = with_options(base, **{name: _changed(name, default)})
        assert changed != base, name
        if section == "control":
            assert prints(changed) == before, f"run-control option {name} changes a fingerprint"
        else:
            assert prints(changed) != before, f"option {name} changes no stage fingerprint"


def test_every_flag_sets_the_option_of_its_name_with_the_configs_default() -> None:
    """Defaults live in the configs only: no flag has its own, and each flag is an option (or one of the
    three resolved first: --model, --chat-template, --s3-endpoint, or --preview, which `mmpack pack` hands to
    the view before any job)."""
    import argparse

    from mmpack.offline_packing.flags import add_arguments, parse_job_args
    from mmpack.offline_packing.options import option_fields

    p = argparse.ArgumentParser()
    add_arguments(p)
    actions = [a for a in p._actions if a.dest != "help"]
    assert len(actions) > 40
    assert [a.dest for a in actions if a.default is not argparse.SUPPRESS] == []
    resolved = {"model", "chat_template_file", "s3_endpoint", "preview"}
    assert {a.dest for a in actions} - resolved <= set(option_fields())
    plain = parse_job_args(
        ["-i", "x.jsonl", "-o", "o", "-L", "64", "-t", BYTE_TOKENIZER], prog="t", description=""
    )
    assert plain == job_config(inputs=("x.jsonl",), output="o", seq_len=64, tokenizer=BYTE_TOKENIZER)
    flags = ["--seed", "3", "--video-fps", "1", "--patch-size", "16", "--default-system", "Hi.", "-w", "2"]
    given = parse_job_args(
        ["-i", "x.jsonl", "-o", "o", "-L", "64", "-t", BYTE_TOKENIZER, *flags], prog="t", description=""
    )
    assert given == with_options(
        plain, seed=3, video_fps=1.0, patch_size=16, chat_default_system="Hi.", workers=2
    )
    assert given.lengths.video_rule.patch_size == 16  # the video rule's patch sizes are the image rule's
