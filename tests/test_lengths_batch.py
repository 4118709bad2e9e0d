"""The lengths stage's batched tokenization (`tokenize_chunk_samples`) gives what one sample at a time gives."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mmpack.offline_packing import lengths
from mmpack.offline_packing.config import LengthsStage
from mmpack.offline_packing.errors import PackError, SampleReject
from mmpack.offline_packing.options import job_config
from mmpack.packing.tokenizer import BYTE_TOKENIZER, ByteTokenizer


def _cfg(tmp_path: Path, overlength: str) -> LengthsStage:
    job = job_config(
        inputs=(str(tmp_path / "in.jsonl"),),
        output=str(tmp_path / "out"),
        seq_len=120,
        tokenizer=BYTE_TOKENIZER,
        overlength=overlength,
    )
    return job.stage_config("lengths")


def _scanned(i: int, text: str, wh: list[list[int]] | None = None, tags: int | None = None) -> dict:
    wh = wh or []
    tags = len(wh) if tags is None else tags
    return {
        "src": "in.jsonl",
        "line": i + 1,
        "id": f"s{i}",
        "wh": wh,
        "images": [f"img{i}_{k}.png" for k in range(len(wh))],
        "fmt": ["png"] * len(wh),
        "nbytes": [100] * len(wh),
        "messages": [["user", "<image>" * tags + "Q?"], ["assistant", text]],
    }


SAMPLES = [
    _scanned(0, "short answer"),
    _scanned(1, "with an image", [[64, 64]]),
    _scanned(2, "x" * 300),  # over seq_len
    _scanned(3, "too wide", [[20000, 10]]),  # the image rule refuses it
    _scanned(4, "two images " * 3, [[56, 56], [112, 56]]),
    _scanned(5, "\n\nleading newlines 😀"),
    _scanned(6, "last one"),
]


def _one_by_one(cfg, samples):
    tok = ByteTokenizer()
    out = []
    for s in samples:
        try:
            out.append((s, lengths.tokenize_scanned(s, cfg, tok)))
        except SampleReject as exc:
            out.append((s, exc))
    return out


def _same(a, b) -> bool:
    (sa, ra), (sb, rb) = a, b
    if sa is not sb or type(ra) is not type(rb):
        return False
    if isinstance(ra, SampleReject):
        return (ra.reason, ra.message) == (rb.reason, rb.message)
    (ta, ma), (tb, mb) = ra, rb
    same_tok = all(
        np.array_equal(x, y) if isinstance(x, np.ndarray) else x == y
        for x, y in zip(vars(ta).values(), vars(tb).values())
    )
    return same_tok and ma == mb


@pytest.mark.parametrize("batch", [1, 2, 3, 256])
@pytest.mark.parametrize("overlength", ["drop", "truncate"])
def test_batched_equals_one_by_one(tmp_path: Path, monkeypatch, batch: int, overlength: str) -> None:
    cfg = _cfg(tmp_path, overlength=overlength)
    monkeypatch.setattr(lengths, "ENCODE_BATCH", batch)
    got = list(lengths.tokenize_chunk_samples(SAMPLES, cfg, ByteTokenizer()))
    want = _one_by_one(cfg, SAMPLES)
    assert len(got) == len(want) == len(SAMPLES)
    assert all(_same(a, b) for a, b in zip(got, want))
    kinds = [type(r).__name__ for _, r in got]
    assert kinds.count("SampleReject") == (2 if overlength == "drop" else 1)
    # control: results compared against another sample's are told apart
    assert not _same(got[0], (SAMPLES[0], want[6][1]))


@pytest.mark.parametrize("batch", [1, 4, 256])
def test_errors_come_in_sample_order(tmp_path: Path, monkeypatch, batch: int) -> None:
    """An error is raised at the sample causing it, after the earlier samples' results, whether it comes from
    rendering (an image without its tag) or from the encoded length (--overlength error)."""
    monkeypatch.setattr(lengths, "ENCODE_BATCH", batch)
    cfg = _cfg(tmp_path, overlength="error")
    tok = ByteTokenizer()
    samples = [SAMPLES[0], SAMPLES[1], SAMPLES[2], _scanned(7, "no tag", [[64, 64]], tags=0)]
    it = lengths.tokenize_chunk_samples(samples, cfg, tok)
    assert next(it)[0] is SAMPLES[0] and next(it)[0] is SAMPLES[1]
    with pytest.raises(PackError, match=r"in\.jsonl:3: overlength"):
        next(it)
    later = lengths.tokenize_chunk_samples([SAMPLES[0], samples[3], SAMPLES[2]], cfg, tok)
    assert next(later)[0] is SAMPLES[0]
    with pytest.raises(ValueError, match="<image> tags"):
        next(later)

    def bad_rows():
        yield SAMPLES[0]
        yield SAMPLES[1]
        raise OSError("unreadable scan chunk")

    drop = replace(cfg, lengths=replace(cfg.lengths, overlength="drop"))
    rows = lengths.tokenize_chunk_samples(bad_rows(), drop, tok)
    assert [s["id"] for s, _ in [next(rows), next(rows)]] == ["s0", "s1"]
    with pytest.raises(OSError, match="unreadable"):
        next(rows)
