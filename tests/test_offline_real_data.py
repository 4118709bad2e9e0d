"""The packer on real data: LLaMA-Factory's mllm_demo records + JPEGs with the real Qwen3 tokenizer.

Checked independently of mmpack.packing.chat: the rendered text is rebuilt here, encoded with plain `tokenizers`,
image-token counts follow a local copy of Qwen2-VL's smart_resize, and loss-mask runs are decoded back.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from mmpack.offline_packing.options import job_config
from mmpack.offline_packing.pipeline import read_manifest, run_pack
from tests.support.fixtures_data import read_arrow_bins, read_wds_bins

pytestmark = pytest.mark.shared
QWEN3_SHA256 = "aeb13307a71acd8fe81861d94ad54ab689df773318809eed3cbe794b4492dae4"


def _smart_resize_tokens(h: int, w: int, factor: int = 28, min_px: int = 3136, max_px: int = 12845056) -> int:
    hb, wb = round(h / factor) * factor, round(w / factor) * factor
    if hb * wb > max_px:
        beta = math.sqrt(h * w / max_px)
        hb, wb = math.floor(h / beta / factor) * factor, math.floor(w / beta / factor) * factor
    elif hb * wb < min_px:
        beta = math.sqrt(min_px / (h * w))
        hb, wb = math.ceil(h * beta / factor) * factor, math.ceil(w * beta / factor) * factor
    return (hb // factor) * (wb // factor)


def _render(messages: list[dict], n_tokens: list[int]) -> str:
    out, images = [], iter(n_tokens)
    for msg in messages:
        parts = msg["content"].split("<image>")
        content = parts[0] + "".join(
            "<|vision_start|>" + "<|image_pad|>" * next(images) + "<|vision_end|>" + p for p in parts[1:]
        )
        out.append(f"<|im_start|>{msg['role']}\n{content}<|im_end|>\n")
    return "".join(out)


@pytest.fixture(scope="module")
def packed_demo(tmp_path_factory: pytest.TempPathFactory):
    from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_shared

    need_shared(MLLM_DEMO_JSON, QWEN3_TOKENIZER, what="mllm_demo, the Qwen3 tokenizer")
    out = tmp_path_factory.mktemp("demo") / "out"
    cfg = job_config(
        inputs=(str(MLLM_DEMO_JSON),),
        output=str(out),
        seq_len=1024,
        tokenizer=str(QWEN3_TOKENIZER),
        format="both",
        progress=False,
    )
    return out, run_pack(cfg), MLLM_DEMO_JSON, QWEN3_TOKENIZER


def test_mllm_demo_ids_lengths_and_loss_mask(packed_demo) -> None:
    from PIL import Image
    from tokenizers import Tokenizer

    out, summary, demo_json, tok_path = packed_demo
    records = json.loads(demo_json.read_text())
    tok = Tokenizer.from_file(str(tok_path))
    assert (summary.samples_read, summary.samples_packed, summary.samples_rejected) == (6, 6, 0)
    m = read_manifest(str(out))
    assert m["tokenizer"]["sha256"] == QWEN3_SHA256 and m["tokenizer"]["special_ids"]["image_pad"] == 151655
    rows = [r for e in m["shards"] if e["format"] == "arrow" for r in read_arrow_bins(out / e["path"])]
    assert rows == [r for e in m["shards"] if e["format"] == "wds" for r in read_wds_bins(out / e["path"])]

    # stage-2 counts, per sample id, from the work folder
    stage2 = {}
    for samples in sorted((out / "_work" / "lengths").glob("chunk-*.samples.jsonl")):
        offsets = np.load(str(samples).replace("samples.jsonl", "offsets.npy"))
        metas = [json.loads(x) for x in samples.read_text().splitlines()]
        stage2.update({meta["id"]: int(n) for meta, n in zip(metas, np.diff(offsets))})

    seen = 0
    for row in rows:
        starts = np.concatenate([[0], np.cumsum(row["seq_lens"])])
        for k, sid in enumerate(row["sample_ids"]):
            line = int(sid.rsplit(":", 1)[1])
            index = next(i for i, r in enumerate(records) if _first_line(demo_json, i) == line)
            rec = records[index]
            sizes = [Image.open(demo_json.parent / p).size for p in rec["images"]]
            text = _render(rec["messages"], [_smart_resize_tokens(h, w) for w, h in sizes])
            ids = row["input_ids"][starts[k] : starts[k + 1]]
            assert ids == tok.encode(text, add_special_tokens=False).ids
            assert row["seq_lens"][k] == stage2[sid]
            mask = np.array(row["loss_mask"][starts[k] : starts[k + 1]])
            runs = _runs_of_ones(mask)
            answers = [m_["content"] for m_ in rec["messages"] if m_["role"] == "assistant"]
            assert [tok.decode(ids[a:b], skip_special_tokens=False) for a, b in runs] == [
                a + "<|im_end|>" for a in answers
            ]
            seen += 1
    assert seen == 6


def _first_line(path: Path, index: int) -> int:
    """1-based line where element `index` of the top-level JSON array starts."""
    text = path.read_text()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    for i in range(index + 1):
        while text[pos] in " \t\r\n,":
            pos += 1
        if i == index:
            return text.count("\n", 0, pos) + 1
        _, pos = decoder.raw_decode(text, pos)
    raise AssertionError


def _runs_of_ones(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(edges == 1).tolist(), np.flatnonzero(edges == -1).tolist()))
