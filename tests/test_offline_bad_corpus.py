"""Every reject reason through the whole job at once, under a time limit: each bad record lands in rejects.jsonl
with its file, line and reason, samples read = packed + rejected, and nothing hangs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mmpack.offline_packing.errors import REJECT_REASONS
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from tests.support.bad_corpus import ROOT_CANNOT_TEST, UNREACHABLE, make_bad_corpus
from tests.support.fixtures_data import train_tiny_bpe
from tests.support.timeouts import deadline


@pytest.mark.slow
def test_every_reject_reason_through_the_whole_job(tmp_path: Path) -> None:
    corpus = make_bad_corpus(tmp_path / "raw")
    tok = train_tiny_bpe(tmp_path / "tok", video_pad=True)
    out = tmp_path / "out"
    cfg = job_config(
        inputs=tuple(str(p) for p in corpus.inputs), output=str(out), tokenizer=str(tok), progress=False,
        **corpus.options,
    )  # fmt: skip
    with deadline(300):
        summary = run_pack(cfg)
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    got = {(Path(r["source"]).name, r["line"]): r["reason"] for r in rejects}
    assert got == corpus.expected
    assert all(r["message"] and "\n" not in r["message"] for r in rejects)
    counts = read_manifest(str(out))["counts"]
    assert counts["samples_read"] == counts["samples_packed"] + counts["samples_rejected"]
    assert counts["samples_packed"] == corpus.n_good and counts["samples_rejected"] == len(corpus.expected)
    assert summary.samples_read == counts["samples_read"]
    not_here = set(UNREACHABLE) | (set(ROOT_CANNOT_TEST) if os.geteuid() == 0 else set())
    assert set(got.values()) == set(REJECT_REASONS) - not_here  # every reason, each at least once


def test_the_packing_guide_lists_every_reject_reason() -> None:
    guide = (Path(__file__).resolve().parents[1] / "docs" / "packing.md").read_text()
    missing = [reason for reason in REJECT_REASONS if f"`{reason}`" not in guide]
    assert not missing, f"docs/packing.md does not list {missing}"
