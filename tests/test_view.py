"""`mmpack view`: the page of a packed dataset, opened in a real headless browser (chromium, `--dump-dom`), shows
each sample's decoded text, marks as trained exactly the tokens the loader's labels train, holds each bin's
images at the model's size and the rejects with their reason; the raw preview of the shared mllm_demo records
renders the token ids of transformers' `apply_chat_template` (default system prompt included), and so do the same
records as Parquet, a WebDataset tar (its images shown) and two JSON Lines files, each form's first records copied
at the lines the job reads them at; a missing shard and an image that does not decode are each one line naming the
file, and the rest still shows; `--serve` renders a bin on request; `mmpack pack --preview N` packs the first records with the job's flags; a dataset in S3 (moto) and
a mixture show their sources, each with its own figures."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
from PIL import Image

from mmpack.cli import main as mmpack
from mmpack.dataloader.collate import CollateConfig, collate_bins
from mmpack.dataloader.manifest import load_manifest
from mmpack.dataloader.readers import open_shard_reader
from mmpack.packing.layout import IGNORE_INDEX
from tests.support.browser import Node, dump_dom, need_chromium, parse_dom
from tests.support.fixtures_chat import hf_messages, qwen2_vl_model_folder
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_shared

BAD_RECORDS = [  # rejected by the packer, each for its reason
    {"id": "bad-missing-image", "image": "images/nowhere.jpg",
     "conversations": [{"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "a cat"}]},
    {"id": "bad-role", "conversations": [{"from": "narrator", "value": "hi"}, {"from": "gpt", "value": "ok"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic records (two of them bad) packed by the real offline job into 3 Arrow shards."""
    from mmpack.demo.synthetic import make_synthetic_dataset, pack_synthetic, train_tiny_bpe

    root = tmp_path_factory.mktemp("view")
    raw = make_synthetic_dataset(root / "raw", n_samples=40, seed=3, size_range=(28, 84), max_words=30)
    with raw.jsonl_path.open("a") as f:
        f.writelines(json.dumps(r) + "\n" for r in BAD_RECORDS)
    tokenizer = train_tiny_bpe(root / "tokenizer", seed=0)
    pack_synthetic(raw, tokenizer, root / "packed", seq_len=256, format="arrow", max_bins_per_shard=6, seed=3)
    return root


def _view(dataset: Path, packed: Path | str, out: Path, *extra: str) -> int:
    tokenizer = str(dataset / "tokenizer" / "tokenizer.json")
    return mmpack(
        [
            "view",
            str(packed),
            "-o",
            str(out),
            "-t",
            tokenizer,
            "--bins",
            "2",
            "--no-plot",
            "--no-progress",
            *extra,
        ]
    )


def _page(out: Path, tmp_path: Path) -> Node:
    return parse_dom(dump_dom(out / "index.html", tmp_path / "profile"))


def _bin0(packed: Path) -> tuple[dict, np.ndarray]:
    """Bin 0 as the loader reads it, and the labels its collate gives."""
    manifest = load_manifest(str(packed))
    reader = open_shard_reader(str(packed / manifest.shards[0].path), "arrow", label="shard 0")
    rec = reader.read(0)
    reader.close()
    return rec, collate_bins([rec], CollateConfig.from_manifest(manifest)).labels[0]


@pytest.mark.slow
def test_page_shows_text_trained_tokens_images_and_rejects(dataset: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    need_chromium()
    packed, out = dataset / "packed", tmp_path / "view"
    assert _view(dataset, packed, out) == 0
    page = _page(out, tmp_path)
    assert page.find_all("body")[0].attrs.get("data-ready") == "1"
    shown = page.by_id("bin")
    assert shown.attrs["data-bin"] == "0"
    rec, labels = _bin0(packed)
    tokens = shown.find_all("span", cls="tok")
    ids = [int(t.attrs["data-id"]) for t in tokens]
    assert ids == rec["input_ids"].tolist()  # every token of the bin, in order
    # each sample's text, token by token, is the tokenizer's decoding of its ids
    tok = Tokenizer.from_file(str(dataset / "tokenizer" / "tokenizer.json"))
    samples = shown.find_all("div", cls="sample")
    assert [s.attrs["data-sample-id"] for s in samples] == rec["sample_ids"]
    starts = np.concatenate([[0], np.cumsum(rec["seq_lens"])])
    for s, a, b in zip(samples, starts[:-1], starts[1:]):
        text = "".join(t.text() for t in s.find_all("span", cls="tok"))
        assert text == tok.decode(rec["input_ids"][a:b].tolist(), skip_special_tokens=False)
    # exactly the tokens the loader trains on (label of the token before != -100) are marked, both ways
    marked = [j for j, t in enumerate(tokens) if "trained" in t.classes]
    assert marked == [j for j, t in enumerate(tokens) if t.attrs["data-trained"] == "1"]
    expected = (np.flatnonzero(labels[: len(ids) - 1] != IGNORE_INDEX) + 1).tolist()
    assert marked == expected and 0 < len(marked) < len(ids)
    control = np.flatnonzero(labels[: len(ids)] != IGNORE_INDEX).tolist()  # labels not shifted: wrong tokens
    assert marked != control
    assert set(marked) <= set(np.flatnonzero(rec["loss_mask"]).tolist())
    # the bin's images, each at the size of its grid (the model's pixels), at its <|image_pad|> tokens
    figures = shown.find_all("figure", cls="media")
    assert len(figures) == len(rec["images"]) > 0
    for fig, grid in zip(figures, rec["image_grid_thw"]):
        assert fig.attrs["data-grid"] == "x".join(str(int(g)) for g in grid)
        (img,) = fig.find_all("img")
        assert Image.open(out / img.attrs["src"]).size == (int(grid[2]) * 14, int(grid[1]) * 14)
        assert (
            len(fig.find_all("span", cls="tok")) == int(fig.attrs["data-tokens"]) == int(np.prod(grid)) // 4
        )
    # the list of bins counts them too
    row = page.by_id("bins").find_all("tr", data_bin="0")[0]
    assert [c.text() for c in row.find_all("td")][2:4] == [str(len(rec["seq_lens"])), str(len(rec["images"]))]
    # positions on hover: M-RoPE's three axes
    assert all(" t " in t.attrs["title"] and " w " in t.attrs["title"] for t in tokens)
    # the rejects with their reason and file
    rejects = {r.attrs["data-reason"]: r.text() for r in page.by_id("rejects").find_all("tr", cls="reject")}
    assert set(rejects) == {"missing_image", "unknown_role"}
    assert "data.jsonl:41" in rejects["missing_image"] and "nowhere.jpg" in rejects["missing_image"]
    assert page.by_id("problems").find_all("li") == []
    # searching a sample id (index.html#id=...: the page's own search) finds its bin, the sample highlighted
    manifest = load_manifest(str(packed))
    reader = open_shard_reader(str(packed / manifest.shards[0].path), "arrow", label="shard 0")
    wanted = reader.read(1)["sample_ids"][-1]  # bin 1: rendered (--bins 2)
    reader.close()
    found = parse_dom(
        dump_dom(out / "index.html", tmp_path / "profile", fragment="id=" + quote(wanted, safe=""))
    )
    assert found.by_id("bin").attrs["data-bin"] == "1"
    assert [s.attrs["data-sample-id"] for s in found.find_all("div", cls="highlight")] == [wanted]


@pytest.mark.slow
def test_missing_shard_and_corrupt_image_are_one_line_each(
    dataset: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    need_chromium()
    packed = tmp_path / "packed"
    shutil.copytree(dataset / "packed", packed)
    manifest = json.loads((packed / "manifest.json").read_text())
    first, second = (packed / s["path"] for s in manifest["shards"][:2])
    second.unlink()
    rec, _ = _bin0(dataset / "packed")
    data = bytearray(first.read_bytes())
    at = data.find(rec["images"][0])
    assert at > 0
    data[at : at + 64] = b"\0" * 64  # the first image of bin 0 no longer decodes
    first.write_bytes(bytes(data))
    out = tmp_path / "view"
    assert _view(dataset, packed, out) == 0
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("mmpack view: problem:")]
    assert len(lines) == 2, lines
    assert sum(str(second) in x and "missing" in x for x in lines) == 1
    first_pad = int(np.flatnonzero(rec["input_ids"] == load_manifest(str(packed)).image_pad_id)[0])
    owner = int(np.searchsorted(np.cumsum(rec["seq_lens"]), first_pad, side="right"))
    assert sum(str(first) in x and f"sample {rec['sample_ids'][owner]} dropped" in x for x in lines) == 1
    page = _page(out, tmp_path)
    assert [li.text() for li in page.by_id("problems").find_all("li", cls="problem")] == [
        x.removeprefix("mmpack view: problem: ") for x in lines
    ]
    # the rest still shows: bin 0 (its first sample dropped, no token of it trained) and the bin list
    shown = page.by_id("bin")
    dropped = shown.find_all("div", cls="sample")[owner]
    assert "dropped" in dropped.classes and not dropped.find_all("span", cls="trained")
    rows = page.by_id("bins").find_all("tr")
    assert len(rows) > 1


@pytest.mark.slow
def test_serve_renders_a_bin_on_request(dataset: Path, tmp_path: Path) -> None:
    """`--serve` (on a free port, in a thread): index.html is served, and a bin the folder does not hold is
    rendered when the page asks for it; a bin the dataset lacks is a 404; the server stops and frees its port."""
    import threading
    import urllib.error
    import urllib.request

    from mmpack.view.serve import start_server
    from mmpack.view.site import ViewOptions

    packed, out = dataset / "packed", tmp_path / "view"
    assert _view(dataset, packed, out, "--bins", "1") == 0
    last = load_manifest(str(packed)).num_bins - 1
    target = out / f"bin/b{last:09d}.js"
    assert last > 0 and not target.exists()  # control: not rendered by the report itself
    opts = ViewOptions(tokenizer=str(dataset / "tokenizer" / "tokenizer.json"), progress=False)
    view = start_server(out, packed, opts, port=0)
    thread = threading.Thread(target=view.serve_forever, daemon=True)
    thread.start()
    try:
        base = view.url.removesuffix("index.html")
        with urllib.request.urlopen(view.url, timeout=30) as r:
            assert r.status == 200 and b"<title>mmpack view</title>" in r.read()
        with urllib.request.urlopen(f"{base}bin/b{last:09d}.js", timeout=60) as r:
            body = r.read().decode()
        assert body.startswith("VIEW.bin(") and target.is_file()
        shown = _bin_json(body)
        reader = open_shard_reader(
            str(packed / load_manifest(str(packed)).shards[-1].path), "arrow", label="s"
        )
        assert shown["bin"] == last and shown["ids"] == reader.read(len(reader) - 1)["input_ids"].tolist()
        reader.close()
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}bin/b{last + 1:09d}.js", timeout=30)
        assert missing.value.code == 404
    finally:
        view.server.shutdown()
        thread.join(timeout=30)
        view.close()
    assert not thread.is_alive()
    with pytest.raises(urllib.error.URLError):  # the port is closed
        urllib.request.urlopen(view.url, timeout=5)


@pytest.mark.slow
def test_pack_preview_packs_the_first_records_with_the_jobs_flags(dataset: Path, tmp_path: Path) -> None:
    """`mmpack pack ... --preview N`: nothing packed at -o; the first N records packed with the job's own flags
    (here one bin per shard) and shown in OUTPUT.preview, their ids naming the original file and lines."""
    raw = dataset / "raw" / "data.jsonl"
    output = tmp_path / "packed"
    argv = [
        "pack",
        "-i",
        str(raw),
        "-r",
        str(dataset / "raw"),
        "-t",
        str(dataset / "tokenizer" / "tokenizer.json"),
    ]
    argv += ["-L", "256", "-o", str(output), "--max-bins-per-shard", "1", "--no-progress"]
    assert mmpack([*argv, "--preview", "6"]) == 0
    assert not output.exists()
    page = tmp_path / "packed.preview"
    assert (page / "index.html").is_file()
    manifest = load_manifest(str(page / "_packed" / "dataset"))
    assert manifest.num_bins > 1 and [s.bins for s in manifest.shards] == [1] * manifest.num_bins
    counts = manifest.raw["counts"]
    assert counts["samples_read"] == 6 and counts["samples_packed"] == 6
    # the first 6 records, a record without an id of its own named by the original file and its line
    lines = raw.read_text().splitlines()[:6]
    expected = {json.loads(x).get("id") or f"{raw.resolve()}:{i}" for i, x in enumerate(lines, 1)}
    shown = [s for b in range(manifest.num_bins) for s in _bin_data(page, b)["samples"]]
    assert sorted(s["id"] for s in shown) == sorted(expected)
    assert {s["source"] for s in shown if ":" in s["id"]} == {str(raw.resolve())}


@pytest.mark.slow
def test_dataset_in_s3_and_a_mixture(dataset: Path, tmp_path: Path) -> None:
    """A mixture of the local dataset and its copy in S3 (moto) shows its sources, numbers the bins through them
    and names each bin's source; the S3 dataset alone, one shard deleted, shows the rest and one line naming that
    shard's URL."""
    from tests.support.storage_servers import moto_s3

    need_chromium()
    packed = dataset / "packed"
    rec, _ = _bin0(packed)
    n = load_manifest(str(packed)).num_bins
    with moto_s3() as s3:
        url = s3.upload_folder(packed, "view", "ds")
        remote = ["--s3-endpoint", s3.endpoint_url]
        mix = tmp_path / "mix.yaml"
        here, there = json.dumps(str(packed)), json.dumps(url)
        mix.write_text(
            f"sources:\n  - {{path: {here}, weight: 3, name: here}}\n  - {{path: {there}, weight: 1, name: there}}\n"
        )
        out = tmp_path / "mixture"
        cache = ["--cache-dir", str(tmp_path / "c1")]
        assert _view(dataset, mix, out, "--bins", "1", "--bin", str(n), *remote, *cache) == 0
        overview = _script_json(out / "overview.js", "overview")
        assert overview["num_bins"] == 2 * n and overview["path"] == str(mix)
        assert [(x["name"], x["path"], x["first_bin"], x["bins"]) for x in overview["sources"]] == [
            ("here", str(packed), 0, n),
            ("there", url, n, n),
        ]
        assert [round(x["share"], 6) for x in overview["sources"]] == [0.75, 0.25]
        assert _script_json(out / "problems.js", "problems") == []
        # each source's own figures in the browser, beside the summed ones (control: the sums are twice them)
        page = _page(out, tmp_path)
        counts = load_manifest(str(packed)).raw["counts"]
        seq_len = load_manifest(str(packed)).seq_len
        images = sum(len(r["images"]) for r in _all_bins(packed))
        own = f"{counts['samples_packed']} / {counts['samples_read']}"
        fill = f"{100 * counts['tokens'] / (n * seq_len):.2f}%"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts["rejected_by_reason"].items()))
        for row in page.by_id("sources").find_all("tr", cls="source"):
            cells = {c.attrs["data-key"]: c.text() for c in row.find_all("td") if "data-key" in c.attrs}
            assert (cells["samples"], cells["fill"], cells["images"], cells["rejects"]) == (
                own,
                fill,
                str(images),
                reasons,
            ), row.attrs["data-source"]
        summed = (
            page.by_id("stats").find_all("tr", data_key="samples packed / read")[0].find_all("td")[0].text()
        )
        assert summed == f"{2 * counts['samples_packed']} / {2 * counts['samples_read']}" != own
        for b, name in ((0, "here"), (n, "there")):  # the first bin of each source is bin 0 of the dataset
            shown = _bin_data(out, b)
            assert shown["source"] == name and shown["ids"] == rec["input_ids"].tolist()
        assert _bin_data(out, n)["shard"].startswith(url + "/")
        # the S3 dataset alone, its second shard gone from the bucket (and a new cache: the old one holds it)
        manifest = json.loads((packed / "manifest.json").read_text())
        gone = f"{url}/{manifest['shards'][1]['path']}"
        s3.filesystem().rm(gone.removeprefix("s3://"))
        out = tmp_path / "remote"
        assert _view(dataset, url, out, "--bins", "1", *remote, "--cache-dir", str(tmp_path / "c2")) == 0
    problems = _script_json(out / "problems.js", "problems")
    assert len(problems) == 1 and gone in problems[0], problems
    assert _script_json(out / "overview.js", "overview")["path"] == url
    assert _bin_data(out, 0)["ids"] == rec["input_ids"].tolist()


def test_manifest_of_a_newer_version_is_one_line(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    packed = tmp_path / "packed"
    packed.mkdir()
    manifest = {"format": "mmpack-packed", "version": 99, "seq_len": 64, "formats": ["arrow"], "shards": []}
    (packed / "manifest.json").write_text(json.dumps(manifest))
    assert mmpack(["view", str(packed), "-o", str(tmp_path / "view"), "--no-progress"]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmpack view: error:"), err
    assert str(packed / "manifest.json") in err[0] and "version 99" in err[0], err


@pytest.mark.shared
@pytest.mark.slow
def test_raw_preview_renders_the_ids_of_apply_chat_template(tmp_path: Path) -> None:
    """The 6 shared mllm_demo records through a Qwen2-VL model folder around the Qwen3 tokenizer: the page's ids of
    each sample are transformers' (its template's default system prompt first); control: packed without that
    prompt (`--no-default-system`), the ids differ from transformers' exactly by the system turn."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    need_shared(MLLM_DEMO_JSON, QWEN3_TOKENIZER, what="the mllm_demo records and the Qwen3 tokenizer")
    need_chromium()
    model = qwen2_vl_model_folder(tmp_path / "Qwen2-VL", QWEN3_TOKENIZER)
    out = tmp_path / "view"
    argv = ["view", str(MLLM_DEMO_JSON), "-n", "6", "--model", str(model), "-o", str(out), "--no-plot"]
    assert mmpack([*argv, "--no-progress"]) == 0
    page = _page(out, tmp_path)
    samples = page.by_id("bin").find_all("div", cls="sample")
    records = json.loads(MLLM_DEMO_JSON.read_text())
    assert len(samples) == len(records) == 6
    assert {s.attrs["data-source"] for s in samples} == {os.path.abspath(MLLM_DEMO_JSON)}
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(model))
    system = tokenizer("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")["input_ids"]
    by_line = {s.attrs["data-sample-id"].rsplit(":", 1)[1]: s for s in samples}
    for sample, record in zip(sorted(by_line.items(), key=lambda kv: int(kv[0])), records):
        shown = [int(t.attrs["data-id"]) for t in sample[1].find_all("span", cls="tok")]
        expected = _expected_ids(record, tokenizer, processor)
        assert shown == expected
        assert shown[: len(system)] == system  # the default system prompt, shown
        assert sample[1].text().count("<|im_start|>system") == 1
    # control: packed without the template's default system prompt, each sample's ids are transformers' with
    # exactly the system turn missing, so the comparison above would fail, and for that reason alone
    control = tmp_path / "view-no-system"
    argv[argv.index("-o") + 1] = str(control)
    assert mmpack([*argv, "--no-progress", "--bins", "1", "--pack-arg=--no-default-system"]) == 0
    data = _bin_data(control, 0)
    ids = {
        s["id"].rsplit(":", 1)[1]: data["ids"][s["start"] : s["start"] + s["len"]] for s in data["samples"]
    }
    for line, record in zip(sorted(ids, key=int), records):
        expected = _expected_ids(record, tokenizer, processor)
        assert ids[line] != expected and ids[line] == expected[len(system) :]


def _demo_forms(root: Path, swap_first_image: bool = False) -> dict[str, list[str]]:
    """The 6 mllm_demo records written as `mmpack pack -i` also takes them: one Parquet file, one WebDataset tar
    (each record's images as members of its sample, the record naming them by suffix), and two JSON Lines
    files in a folder (3 records each, the second gzip-compressed and with a blank line), named by a glob.
    `swap_first_image`: the tar's first sample holds 2.jpg's bytes under its image's name (a control)."""
    import gzip
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    records = json.loads(MLLM_DEMO_JSON.read_text())
    root.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), root / "demo.parquet")
    with tarfile.open(root / "demo.tar", "w") as tar:
        for k, record in enumerate(records):
            names = sorted(set(record["images"]))
            as_member = {name: f"img{j}.jpg" for j, name in enumerate(names)}
            own = {**record, "images": [as_member[x] for x in record["images"]]}
            members = [(f"{k:06d}.json", json.dumps(own).encode())]
            for name in names:
                data = (MLLM_DEMO_JSON.parent / name).read_bytes()
                if swap_first_image and k == 0:
                    data = (MLLM_DEMO_JSON.parent / "mllm_demo_data/2.jpg").read_bytes()
                members.append((f"{k:06d}.{as_member[name]}", data))
            for name, data in members:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (root / "lines").mkdir(exist_ok=True)
    (root / "lines" / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records[:3]))
    text = json.dumps(records[3]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in records[4:])
    (root / "lines" / "b.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    return {
        "parquet": [str(root / "demo.parquet")],
        "tar": [str(root / "demo.tar")],
        "jsonl": [str(root / "lines" / "*.jsonl*")],
    }


@pytest.mark.shared
@pytest.mark.slow
def test_raw_preview_of_parquet_tar_and_several_files(tmp_path: Path) -> None:
    """The shared mllm_demo records as Parquet, as a WebDataset tar (images inside it) and as two JSON Lines files
    (one gzip, named by a glob) preview with transformers' ids, as the JSON form does, each sample named by its
    original file and line (row, tar sample); the tar's images are shown at the model's size. Control: the tar
    with another image's bytes under the first sample's image name: that sample's ids are no longer
    transformers' (its image's tokens follow the tar's pixels)."""
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    need_shared(MLLM_DEMO_JSON, QWEN3_TOKENIZER, what="the mllm_demo records and the Qwen3 tokenizer")
    need_chromium()
    model = qwen2_vl_model_folder(tmp_path / "Qwen2-VL", QWEN3_TOKENIZER)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    processor = Qwen2VLImageProcessorPil.from_pretrained(str(model))
    records = json.loads(MLLM_DEMO_JSON.read_text())
    expected = [_expected_ids(r, tokenizer, processor) for r in records]
    forms = _demo_forms(tmp_path / "raw")
    files = {  # the record each (original file, line) holds
        "parquet": {(str(tmp_path / "raw" / "demo.parquet"), k + 1): k for k in range(6)},
        "tar": {(str(tmp_path / "raw" / "demo.tar"), k + 1): k for k in range(6)},
        "jsonl": {(str(tmp_path / "raw" / "lines" / "a.jsonl"), k + 1): k for k in range(3)}
        | {(str(tmp_path / "raw" / "lines" / "b.jsonl.gz"), line): k for line, k in ((1, 3), (3, 4), (4, 5))},
    }
    root = ["-r", str(MLLM_DEMO_JSON.parent)]
    for form, inputs in forms.items():
        out = tmp_path / f"view-{form}"
        argv = [
            "view",
            *inputs,
            "-n",
            "6",
            "--model",
            str(model),
            "-o",
            str(out),
            "--no-plot",
            "--no-progress",
        ]
        assert mmpack([*argv, *(root if form != "tar" else [])]) == 0, form
        page = _page(out, tmp_path)
        samples = page.by_id("bin").find_all("div", cls="sample")
        assert len(samples) == 6, form
        for sample in samples:
            source, line = sample.attrs["data-sample-id"].rsplit(":", 1)
            assert sample.attrs["data-source"] == source
            k = files[form][(source, int(line))]
            assert [int(t.attrs["data-id"]) for t in sample.find_all("span", cls="tok")] == expected[k], form
        if form == "tar":  # the images inside the tar, at the size of their grid (the model's pixels)
            figures = page.by_id("bin").find_all("figure", cls="media")
            assert len(figures) == sum(len(r["images"]) for r in records)
            for fig in figures:
                (img,) = fig.find_all("img")
                h, w = (int(x) for x in fig.attrs["data-grid"].split("x")[1:])
                assert Image.open(out / img.attrs["src"]).size == (w * 14, h * 14)
    # control: the first tar sample's image member holds 2.jpg: its ids are not transformers' for record 0
    control = _demo_forms(tmp_path / "control", swap_first_image=True)["tar"]
    out = tmp_path / "view-control"
    argv = ["view", *control, "-n", "1", "--model", str(model), "-o", str(out), "--no-plot", "--no-progress"]
    assert mmpack(argv) == 0
    data = _bin_data(out, 0)
    assert data["samples"][0]["id"] == f"{control[0]}:1"
    assert data["ids"] != expected[0] and len(data["ids"]) != len(expected[0])
    # the tar as a URL (S3, moto): the first 2 records, named by the URL and sample
    from tests.support.storage_servers import moto_s3

    with moto_s3() as s3:
        url = s3.upload_folder(tmp_path / "raw", "raw", "demo") + "/demo.tar"
        out = tmp_path / "view-s3"
        argv = ["view", url, "-n", "2", "--model", str(model), "-o", str(out), "--no-plot", "--no-progress"]
        assert mmpack([*argv, "--s3-endpoint", s3.endpoint_url]) == 0
    data = _bin_data(out, 0)
    shown = {s["id"]: data["ids"][s["start"] : s["start"] + s["len"]] for s in data["samples"]}
    assert shown == {f"{url}:1": expected[0], f"{url}:2": expected[1]}


def _records(path: Path | str) -> list[tuple[int, Any, str | None]]:
    """(line, record, error) of every record of an input file, read by the offline job's own reader."""
    from mmpack.offline_packing.context import JobContext
    from mmpack.offline_packing.inputs.chunks import plan_chunks, read_chunk

    ctx = JobContext(work_dir="")
    return [(r.line, r.obj, r.error) for c in plan_chunks(ctx, [str(path)], 1000) for r in read_chunk(ctx, c)]


def test_first_records_keep_each_forms_records_and_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The raw preview's copies (`view.raw.first_records`) hold, for every input form, the first N records of the
    inputs in the job's order at the lines (rows, tar samples) the job reads them at in the originals, a cut
    inside the second file included. Control: the same records written as plain JSON Lines (no blank lines
    kept) sit at other lines, so the ids of records without an id of their own would differ."""
    import gzip
    import io
    import tarfile

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmpack.view.raw import first_records

    recs = [{"id": f"r{k}", "messages": [{"role": "user", "content": f"q{k}"}]} for k in range(5)]
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = "\n".join(json.dumps(r) for r in recs[:2]) + "\n\n\n" + "\n".join(json.dumps(r) for r in recs[2:])
    (raw / "a.jsonl").write_text(lines + "\n")
    (raw / "b.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (raw / "c.json").write_text(json.dumps(recs, indent=2))  # a pretty-printed array: elements span lines
    (raw / "d.json.gz").write_bytes(gzip.compress(json.dumps(recs, indent=1).encode()))
    (raw / "e.json").write_text(json.dumps(recs[0], indent=2))  # one object: one record
    pq.write_table(pa.Table.from_pylist(recs), raw / "f.parquet")
    with tarfile.open(raw / "g.tar", "w") as tar:
        for k, r in enumerate(recs):
            for name, data in ((f"{k:03d}.json", json.dumps(r).encode()), (f"{k:03d}.txt", b"x")):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    for name in ("a.jsonl", "b.jsonl.gz", "c.json", "d.json.gz", "e.json", "f.parquet", "g.tar"):
        original = _records(raw / name)
        copies = first_records([str(raw / name)], 3, tmp_path / "copy" / name)
        ((copy, src),) = copies.items()
        assert src == str(raw / name) and Path(copy).name == name
        assert _records(copy) == original[:3], name
    # two files, the first N = 7 records in the job's order: all 5 of a.jsonl, the first 2 of b.jsonl.gz (a glob)
    # (the copies named by absolute path, as the job names its inputs, for a relative folder too)
    monkeypatch.chdir(tmp_path)
    copies = first_records([str(raw / "[ab].jsonl*")], 7, Path("two"))
    assert list(copies) == [
        str(tmp_path / "two" / "0" / "a.jsonl"),
        str(tmp_path / "two" / "1" / "b.jsonl.gz"),
    ]
    assert list(copies.values()) == [str(raw / "a.jsonl"), str(raw / "b.jsonl.gz")]
    assert [_records(c) for c in copies] == [_records(raw / "a.jsonl"), _records(raw / "b.jsonl.gz")[:2]]
    # control: the first 3 records of a.jsonl as plain JSON Lines: the third is read at line 3, not 5
    naive = tmp_path / "naive.jsonl"
    naive.write_text("".join(json.dumps(r) + "\n" for r in recs[:3]))
    assert (
        [line for line, _, _ in _records(naive)]
        == [1, 2, 3]
        != [line for line, _, _ in _records(raw / "a.jsonl")][:3]
    )


def _all_bins(packed: Path) -> list[dict]:
    """Every bin of a packed dataset as the loader reads it."""
    manifest = load_manifest(str(packed))
    bins = []
    for k, shard in enumerate(manifest.shards):
        reader = open_shard_reader(str(packed / shard.path), "arrow", label=f"shard {k}")
        bins += [reader.read(j) for j in range(len(reader))]
        reader.close()
    return bins


def _bin_data(out: Path, bin_id: int) -> dict:
    """The page's data of one rendered bin (its `bin/b<bin>.js`), read without a browser."""
    return _bin_json((out / f"bin/b{bin_id:09d}.js").read_text(encoding="utf-8"))


def _script_json(path: Path, call: str) -> Any:
    """The JSON value a report's script file hands the page (`VIEW.<call>(...);`)."""
    text = path.read_text(encoding="utf-8")
    return json.loads(text.removeprefix(f"VIEW.{call}(").rstrip().removesuffix(");"))


def _bin_json(script: str) -> dict:
    """The JSON value of a bin's script file (`VIEW.bin({...});`)."""
    return json.loads(script.removeprefix("VIEW.bin(").rstrip().removesuffix(");"))


def _expected_ids(record: dict, tokenizer, processor) -> list[int]:
    """transformers' ids of a record: `apply_chat_template`, each `<|image_pad|>` expanded to its grid's tokens."""
    text = tokenizer.apply_chat_template(hf_messages(record["messages"]), tokenize=False)
    images = [Image.open(MLLM_DEMO_JSON.parent / p) for p in record.get("images", [])]
    if images:
        grids = processor(images=images, return_tensors="np")["image_grid_thw"]
        pieces = text.split("<|image_pad|>")
        counts = [int(np.prod(g)) // processor.merge_size**2 for g in grids]
        text = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    return tokenizer(text, add_special_tokens=False)["input_ids"]
