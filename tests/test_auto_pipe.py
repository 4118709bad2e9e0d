"""`offline_packing/auto_pipe.sh` takes LLaVA-OneVision-2's command lines as they are: the seven usage examples
of the header of its `offline_packing/auto_pipe.sh`, with only the paths replaced, run on the real mllm_demo
records (OV-2's `messages` + `images`) and a Qwen2-VL model folder; `-s` prints the status, `-S 3` reruns from
bin packing, `-f` reruns everything, options without a meaning in mmpack say so in one line; other flags reach
`mmpack pack` one word each."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fixtures_chat import qwen2_vl_model_folder
from tests.support.fixtures_data import dataset_files
from tests.support.shared import MLLM_DEMO_JSON, QWEN3_TOKENIZER, need_import, need_shared

SCRIPT = Path(__file__).resolve().parents[1] / "offline_packing" / "auto_pipe.sh"
# The usage examples 1-7 of LLaVA-OneVision-2's offline_packing/auto_pipe.sh, as written there.
OV2_EXAMPLES = {
    1: "bash auto_pipe.sh -i /path/to/input.jsonl -r /path/to/images -o /path/to/output_base -L 64000",
    2: "bash auto_pipe.sh -i /vlm/data/sft/mix_v1.jsonl -r /vlm/data/images "
    "-m /vlm/pretrain_models/Qwen/Qwen2.5-VL-3B-Instruct -o /vlm/cache/packed/mix_v1 -L 64000 -M 200 -w 32 "
    "--max-pixels 12845056 --direct-workers 32 --shard-prefix pretrain --sample-class PackedCaptioningSample "
    "--max-samples-per-shard 10000 --max-shard-size 3000000000",
    3: "bash auto_pipe.sh -i ... -r ... -o ... -L 64000 -S 3",
    4: "bash auto_pipe.sh -i ... -r ... -o ... -L 64000 -S 4 --resume-direct",
    5: "bash auto_pipe.sh -i ... -r ... -o ... -L 64000 -f",
    6: "bash auto_pipe.sh -o /vlm/cache/packed/mix_v1 -L 64000 -s",
    7: "bash auto_pipe.sh -i ... -r ... -o ... -L 64000 --no-npy",
}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory holding OV-2's default model folder (Qwen/Qwen2.5-VL-3B-Instruct) and the records."""
    need_shared(QWEN3_TOKENIZER, MLLM_DEMO_JSON, what="the Qwen3 tokenizer, mllm_demo")
    need_import("megatron.energon", extra="energon")
    root = tmp_path_factory.mktemp("site")
    qwen2_vl_model_folder(root / "Qwen" / "Qwen2.5-VL-3B-Instruct", QWEN3_TOKENIZER)
    records = json.loads(MLLM_DEMO_JSON.read_text())
    with_system = [
        {**r, "messages": [{"role": "system", "content": "Answer briefly."}, *r["messages"]]} for r in records
    ]
    lines = [json.dumps(r, ensure_ascii=False) for r in records + with_system]
    (root / "mix_v1.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _run(site: Path, n: int, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """Example `n` with only its paths replaced (the `...` of examples 3-7 are example 2's paths)."""
    paths = {
        "/path/to/input.jsonl": str(site / "mix_v1.jsonl"),
        "/path/to/images": str(MLLM_DEMO_JSON.parent),
        "/path/to/output_base": str(
            site / "mix_v1"
        ),  # one dataset: example 2 is example 1 with OV-2's defaults
        "/vlm/data/sft/mix_v1.jsonl": str(site / "mix_v1.jsonl"),
        "/vlm/data/images": str(MLLM_DEMO_JSON.parent),
        "/vlm/pretrain_models/Qwen/Qwen2.5-VL-3B-Instruct": str(site / "Qwen" / "Qwen2.5-VL-3B-Instruct"),
        "/vlm/cache/packed/mix_v1": str(site / "mix_v1"),
        "-i ... -r ... -o ...": f"-i {site / 'mix_v1.jsonl'} -r {MLLM_DEMO_JSON.parent} -o {site / 'mix_v1'}",
        "auto_pipe.sh": str(SCRIPT),
    }
    line = OV2_EXAMPLES[n]
    for old, new in paths.items():
        line = line.replace(old, new)
    full_env = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(shlex.split(line), cwd=cwd or site, env=full_env, capture_output=True, text=True)


def _marker_times(out: Path) -> dict[str, int]:
    return {s: (out / "_work" / f"{s}.done.json").stat().st_mtime_ns for s in ("scan", "lengths", "binpack")}


def _shards_and_manifest(out: Path) -> dict[str, bytes]:
    return {k: v for k, v in dataset_files(out).items() if not k.startswith(".nv-meta")}


@pytest.mark.shared
@pytest.mark.slow
def test_ov2_usage_examples_run_unchanged(site: Path, tmp_path: Path) -> None:
    status = _run(site, 6)  # -s before any run: every stage to do
    assert status.returncode == 0 and status.stdout.count("[TODO] not started") == 4, status.stderr

    first = _run(site, 1)  # the default model folder, as OV-2 finds it: relative to the working directory
    assert first.returncode == 0, first.stderr
    manifest = json.loads((site / "mix_v1" / "manifest.json").read_text())
    assert manifest["formats"] == ["wds"] and (site / "mix_v1" / ".nv-meta" / "dataset.yaml").is_file()
    assert manifest["algorithm"]["max_items_per_bin"] == 200  # OV-2's default -M
    assert manifest["chat_template"]["default_system"] == "You are a helpful assistant."  # the folder's own
    assert all(Path(e["path"]).name.startswith("pretrain-") for e in manifest["shards"])
    refused = _run(site, 1, cwd=tmp_path)  # no Qwen/Qwen2.5-VL-3B-Instruct folder there
    lines = refused.stderr.strip().splitlines()
    assert (
        refused.returncode == 1 and len(lines) == 1 and lines[0].startswith("auto_pipe.sh: error: no model")
    )

    packed = _shards_and_manifest(site / "mix_v1")
    full = _run(site, 2)  # the "common overrides" are OV-2's defaults: example 1's job, complete already
    assert full.returncode == 0, full.stderr
    assert "--direct-workers 32: stage 4 runs with the -w workers" in full.stderr
    assert "--sample-class PackedCaptioningSample:" in full.stderr
    assert full.stderr.count("skipped (already complete)") == 4
    assert _shards_and_manifest(site / "mix_v1") == packed

    before = _marker_times(site / "mix_v1")
    rerun = _run(site, 3)  # -S 3: bin packing and write again, scan and lengths kept
    assert rerun.returncode == 0, rerun.stderr
    assert "time binpack" in rerun.stderr and "time write" in rerun.stderr
    assert "time scan" not in rerun.stderr and "time lengths" not in rerun.stderr
    after = _marker_times(site / "mix_v1")
    assert after["lengths"] == before["lengths"] and after["binpack"] > before["binpack"]
    assert _shards_and_manifest(site / "mix_v1") == packed

    resumed = _run(site, 4)  # -S 4 --resume-direct: stage 4 finished before, nothing to redo
    assert resumed.returncode == 0 and "--resume-direct: stage 4 resumes" in resumed.stderr, resumed.stderr
    assert "skipped (already complete)" in resumed.stderr.splitlines()[-2]  # the summary's "time write" row

    forced = _run(site, 5)  # -f: every stage again, the same bytes
    assert forced.returncode == 0 and "time scan" in forced.stderr and "time lengths" in forced.stderr
    assert _shards_and_manifest(site / "mix_v1") == packed

    status = _run(site, 6)
    assert status.returncode == 0 and status.stdout.count("[DONE]") == 4, status.stderr
    assert "12 samples kept" in status.stdout and str(site / "mix_v1") in status.stdout

    no_npy = _run(site, 7)
    assert no_npy.returncode == 0, no_npy.stderr
    assert "--no-npy: image tokens always come from each image's size" in no_npy.stderr


def test_flags_reach_mmpack_pack_word_by_word(tmp_path: Path) -> None:
    """What auto_pipe.sh hands `mmpack pack` (a stand-in PYTHON prints it): OV-2's options translated, a value
    with spaces intact, WebDataset + Energon by default, -t instead of the default model."""
    echo = tmp_path / "python"
    echo.write_text('#!/bin/sh\nshift 2\nfor a in "$@"; do printf "%s\\n" "$a"; done\n')
    echo.chmod(0o755)
    model = tmp_path / "Qwen" / "Qwen2.5-VL-3B-Instruct"
    model.mkdir(parents=True)

    def argv(*flags: str) -> list[str]:
        done = subprocess.run(
            ["bash", str(SCRIPT), "-i", "d.jsonl", "-o", "out", "-L", "4096", *flags],
            cwd=tmp_path, env={**os.environ, "PYTHON": str(echo)}, capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout.splitlines()

    got = argv("--default-system", "You are a helpful assistant.", "-w", "3")
    assert got[got.index("--default-system") + 1] == "You are a helpful assistant."
    assert got[got.index("--model") + 1] == "Qwen/Qwen2.5-VL-3B-Instruct" and "--energon" in got
    assert got[got.index("--format") + 1] == "wds" and got[got.index("--workers") + 1] == "3"
    assert (
        got[got.index("--max-samples-per-bin") + 1] == "200"
        and got[got.index("--shard-prefix") + 1] == "pretrain"
    )
    arrow = argv("--format", "arrow", "-t", "tok.json", "-f")
    assert "--energon" not in arrow and "--model" not in arrow and arrow[arrow.index("--stage") + 1] == "1"
    shutil.rmtree(model)
