"""Bounded workers and records (issue 39): every worker count capped at the CPUs the job may use (the stages'
engine and the Energon metadata step), a record's text never handed to the tokenizer past what seq_len tokens can
hold (a 50 MB record), documents and gzip bombs read within a limit, and the
offline job's one-line refusals: an empty `.gz`, a file name that is not UTF-8, a 1 fps clip at timescale 1
accepted. Property tests feed the record readers any bytes."""

from __future__ import annotations

import gzip
import io
import json
import os
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpack.offline_packing.context import JobContext
from mmpack.offline_packing.engines import run_parallel
from mmpack.offline_packing.errors import PackError
from mmpack.offline_packing.inputs import chunks
from mmpack.offline_packing.inputs.chunks import plan_chunks, read_chunk
from mmpack.offline_packing.inputs.json_records import RawRecord
from mmpack.offline_packing.inputs.remote import RemoteFiles
from mmpack.offline_packing.inputs.sources import expand_inputs
from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import run_pack
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.shared import QWEN3_TOKENIZER, need_import, need_shared

FAST = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
GOOD = {"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}


def _sleepy_pid(ctx: object, item: int) -> int:
    time.sleep(0.3)  # long enough that every started worker takes an item
    return os.getpid()


def test_worker_counts_are_capped_at_the_cpus_the_job_may_use() -> None:
    cpus = len(os.sched_getaffinity(0))
    n = cpus + 3
    pids = run_parallel(
        JobContext(work_dir="unused"), _sleepy_pid, list(range(n)), workers=99999, progress=False
    )
    assert len(pids) == n and 1 <= len(set(pids)) <= cpus

    from mmpack.offline_packing.engines.workers import capped_workers, machine_workers

    assert machine_workers() == cpus
    assert capped_workers(99999) == cpus and capped_workers(99999, 3) == min(3, cpus)
    assert capped_workers(0) == 1 and capped_workers(5, 0) == 1


def test_the_energon_metadata_step_forks_no_more_workers_than_cpus_and_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    need_import("megatron.energon", extra="energon")
    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    from mmpack.offline_packing.outputs.energon_meta import write_energon_metadata

    def record(*args: object, workers: int, **kw: object) -> None:
        raise RuntimeError(f"asked for {workers} workers")  # from Energon's own process, raised here

    monkeypatch.setattr(WebdatasetPreparator, "prepare_dataset", record)
    with pytest.raises(RuntimeError, match=r"^asked for 1 workers$"):  # `--energon -w 200` on one shard
        write_energon_metadata(tmp_path, [{"path": "shards/a-000000.tar", "sha256": "0" * 64}], workers=200)


def _pack(inputs: list[Path], out: Path, **kw: object) -> object:
    cfg = job_config(
        inputs=tuple(str(p) for p in inputs), output=str(out), seq_len=512, tokenizer=BYTE_TOKENIZER,
        progress=False, **kw,
    )  # fmt: skip
    return run_pack(cfg)


@pytest.mark.parametrize("content", [b"", gzip.compress(b"")], ids=["zero-bytes", "gzip-of-nothing"])
@pytest.mark.parametrize("name", ["data.jsonl.gz", "data.json.gz"])
def test_an_empty_gz_input_is_an_error_naming_it(tmp_path: Path, content: bytes, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(PackError) as info:
        _pack([path], tmp_path / "out")
    assert str(path) in info.value.message and "\n" not in info.value.message
    assert "empty" in info.value.message or "nothing" in info.value.message


def test_a_gzip_document_that_expands_past_the_limit_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(chunks, "MAX_DOCUMENT_BYTES", 1 << 20, raising=False)
    body = json.dumps([{**GOOD, "pad": " " * (3 << 20)}]).encode()  # one JSON array, 3 MiB
    path = tmp_path / "bomb.json.gz"
    path.write_bytes(gzip.compress(body, 9))
    assert len(body) > 300 * path.stat().st_size  # control: a 300x bomb
    with pytest.raises(PackError) as info:
        _pack([path], tmp_path / "out")
    message = info.value.message
    assert str(path) in message and "expands to" in message and ".jsonl" in message and "\n" not in message


def test_a_file_or_folder_name_that_is_not_utf8_is_refused_naming_it_as_bytes(tmp_path: Path) -> None:
    folder = tmp_path / os.fsdecode(b"d\xe9j\xe0")
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(GOOD) + "\n")
    with pytest.raises(ValueError) as info:
        expand_inputs(RemoteFiles(None), [str(tmp_path)])
    assert repr(os.fsencode(folder / "a.jsonl")) in str(info.value)
    for inputs, out in (([folder / "a.jsonl"], tmp_path / "out"), ([tmp_path], folder / "out")):
        with pytest.raises(ValueError) as info:  # the whole job (-i, -o): one line naming the path
            _pack(inputs, out)
        assert "d\\xe9j\\xe0" in str(info.value) and "\n" not in str(info.value)


def test_a_config_json_that_is_a_json_list_is_one_line_naming_it(tmp_path: Path) -> None:
    from mmpack.offline_packing.model_folder import resolve_video_rule
    from mmpack.packing.image_tokens import ImageTokenRule
    from mmpack.trainer.models import read_hf_config

    config = tmp_path / "config.json"
    config.write_text("[1, 2]")
    for read in (
        lambda: read_hf_config(tmp_path),  # --hf-model, mmpack convert
        lambda: resolve_video_rule(str(tmp_path), None, {}, ImageTokenRule()),  # mmpack pack --model
    ):
        with pytest.raises(ValueError) as info:
            read()
        assert str(config) in str(info.value) and "\n" not in str(info.value)


def test_a_one_fps_clip_at_timescale_one_is_accepted(tmp_path: Path) -> None:
    import av

    from mmpack.offline_packing.inputs.video_probe import probe_video
    from tests.support.video_fixtures import encode_video

    clip = encode_video(tmp_path / "slow.mp4", 6, rate=1, options={"video_track_timescale": "1"})
    with av.open(str(clip)) as container:
        assert float(container.streams.video[0].time_base) == 1.0  # control: one tick a second
    meta = probe_video(clip).meta
    assert (meta.total_frames, meta.fps, meta.frame_count_exact) == (6, 1.0, True)


@pytest.mark.shared
def test_a_50mb_record_never_reaches_the_tokenizer(tmp_path: Path) -> None:
    """The 50 MB record that aborted `mmpack pack` under a 4 GB limit (SIGABRT in the tokenizer, whose memory is
    about 125 bytes per character) is over-length before it is encoded; what reaches the tokenizer stays within
    seq_len x max_token_chars characters (the peak RSS of the whole job on it is in docs/packing.md)."""
    need_shared(QWEN3_TOKENIZER, what="the Qwen3 tokenizer")
    from mmpack.offline_packing import lengths
    from mmpack.packing.tokenizer import load_tokenizer

    cfg = job_config(
        inputs=("in.jsonl",), output=str(tmp_path / "out"), seq_len=4096, tokenizer=str(QWEN3_TOKENIZER)
    ).stage_config("lengths")
    tok = load_tokenizer(QWEN3_TOKENIZER)
    limit = 4096 * 512  # 4 x the longest Qwen3 vocabulary entry (128 bytes) per token
    encode, encoded = tok.encode_batch_arrays, []

    def spy(texts: list[str]) -> list:
        encoded.extend(map(len, texts))
        assert max(map(len, texts), default=0) <= limit, "a text past the limit reached the tokenizer"
        return encode(texts)

    tok.encode_batch_arrays = spy  # type: ignore[method-assign]
    rows = [("word " * 10_000_000, "big"), ("Hello.", "small")]
    samples = [
        {"src": "in.jsonl", "line": i + 1, "id": name, "wh": [], "images": [], "fmt": [], "nbytes": [],
         "messages": [["user", "Hi?"], ["assistant", text]]}
        for i, (text, name) in enumerate(rows)
    ]  # fmt: skip
    (big, reject), (small, kept) = lengths.tokenize_chunk_samples(samples, cfg, tok)
    assert big["id"] == "big"
    assert reject.reason == "overlength" and "not tokenized" in reject.message and "50000" in reject.message
    assert small["id"] == "small" and len(kept[0]) > 0 and max(encoded) < 100
    assert tok.max_token_chars == 512


# --- property tests: the record readers take any bytes --------------------------------------------------------

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet")


def _parquet_bytes(rows: list[dict]) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows) if rows else pa.table({"a": pa.array([], pa.string())}), sink)
    return sink.getvalue()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
text_blobs = st.one_of(
    st.binary(max_size=300),
    st.lists(json_values, max_size=4).map(lambda vs: "\n".join(json.dumps(v) for v in vs).encode()),
    st.lists(json_values, max_size=4).map(lambda vs: json.dumps(vs).encode()),
    # an integer past Python's digit limit: json raises a ValueError that is no JSONDecodeError
    st.sampled_from([b'{"n": 1%s}\n{"m": 2}', b'[{"n": 1%s}]']).map(lambda form: form % (b"0" * 5000)),
)


@st.composite
def input_files(draw: st.DrawFn) -> tuple[str, bytes]:
    suffix = draw(st.sampled_from(SUFFIXES))
    if suffix == ".parquet":
        rows = draw(
            st.lists(
                st.fixed_dictionaries({"text": st.text(max_size=10), "n": st.integers(0, 9)}), max_size=3
            )
        )
        data = _parquet_bytes(rows)
        if draw(st.booleans()):  # damaged: some bytes overwritten
            at = draw(st.integers(0, len(data) - 1))
            data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at + 8 :]
        return suffix, draw(st.sampled_from([data, draw(st.binary(max_size=200))]))
    blob = draw(text_blobs)
    if suffix.endswith(".gz"):
        packed = gzip.compress(blob)
        choice = draw(st.sampled_from(["whole", "cut", "raw"]))
        blob = (
            packed
            if choice == "whole"
            else packed[: draw(st.integers(0, len(packed)))]
            if choice == "cut"
            else blob
        )
    return suffix, blob


@FAST
@given(case=input_files(), max_record_bytes=st.sampled_from([16, 1 << 20]))
def test_any_bytes_give_records_or_a_one_line_error(
    tmp_path: Path, case: tuple[str, bytes], max_record_bytes: int
) -> None:
    suffix, data = case
    path = tmp_path / f"input-{len(data)}{suffix}"
    path.write_bytes(data)
    ctx = JobContext(work_dir="unused")
    try:
        records = [
            r
            for c in plan_chunks(ctx, [str(path)], 3, max_record_bytes)
            for r in read_chunk(ctx, c, max_record_bytes)
        ]
    except PackError as exc:
        assert str(path) in exc.message and "\n" not in exc.message
        return
    for record in records:
        assert (
            isinstance(record, RawRecord)
            and record.line >= 1
            and (record.error is None or record.obj is None)
        )
        if record.error is not None:
            assert "\n" not in record.error
        elif suffix == ".parquet":
            assert isinstance(record.obj, dict)
