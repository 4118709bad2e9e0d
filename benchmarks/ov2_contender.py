"""mmpack's auto_pipe.sh against LLaVA-OneVision-2's own offline packer (its offline_packing/auto_pipe.sh, s1-s4)
on the same records, the same model folder and the same command line: CPU s, wall s, peak PSS of the process
tree, bins, fill, rejects, and whether both kept the same samples with the same token counts.

    python benchmarks/bench_offline.py --ov2-only --ov2-repo /path/to/LLaVA-OneVision-2 --ov2-python /tmp/ov2/bin/python

The contender runs in its own Python environment (`--ov2-python`); on this project's CPU-only machines:

    python -m venv /tmp/ov2 && echo "$(python -c 'import site; print(site.getsitepackages()[0])')" \\
        > /tmp/ov2/lib/python3.11/site-packages/mmpack-venv.pth     # torch, transformers, webdataset, energon
    /tmp/ov2/bin/pip install --no-deps qwen-vl-utils==0.0.14

Two things are needed there for OV-2's code to run at all, neither touching it: torchvision's wheels on the
package index are CUDA builds that do not load beside the CPU torch, so (1) qwen-vl-utils' top-level
`import torchvision` (used for videos only) is made optional in that venv (`make_qwen_vl_utils_importable`),
and (2) the model folder names a processor class of its own (`ImageTextQwen2VLProcessor`, Qwen2-VL's without
its torchvision video processor), which OV-2's `AutoProcessor.from_pretrained(..., trust_remote_code=True)`
loads. The records hold no videos, so neither change alters a token count.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks.pss import PeakPss  # noqa: E402

PROCESSOR_MODULE = '''"""Qwen2-VL's processor without its video processor (which needs torchvision's compiled ops)."""

from transformers.models.qwen2_vl.processing_qwen2_vl import Qwen2VLProcessor
from transformers.processing_utils import ProcessorMixin


class ImageTextQwen2VLProcessor(Qwen2VLProcessor):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
'''


def make_model_folder(folder: Path, tokenizer_file: Path) -> Path:
    """A Qwen2-VL model folder both packers read: tokenizer, Qwen2-VL's chat template, preprocessor config, and
    the processor class OV-2's AutoProcessor loads."""
    from tests.support.fixtures_chat import qwen2_vl_model_folder

    qwen2_vl_model_folder(folder, tokenizer_file)
    (folder / "processing_image_text.py").write_text(PROCESSOR_MODULE)
    auto_map = {"AutoProcessor": "processing_image_text.ImageTextQwen2VLProcessor"}
    config = {"processor_class": "ImageTextQwen2VLProcessor", "auto_map": auto_map}
    (folder / "processor_config.json").write_text(json.dumps(config))
    return folder


def make_qwen_vl_utils_importable(python: str) -> None:
    """qwen-vl-utils imports torchvision at the top for its video functions; make that import optional in the
    contender's venv (idempotent)."""
    code = "import importlib.util; print(importlib.util.find_spec('qwen_vl_utils').submodule_search_locations[0])"
    folder = Path(
        subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    )
    path = folder / "vision_process.py"
    text = path.read_text()
    plain = "\nimport torchvision\n"
    if plain not in text:
        return
    optional = (
        "\ntry:  # video only: made optional for a CPU torch without torchvision\n    import torchvision\n"
        "    from torchvision import io, transforms\n    from torchvision.transforms import InterpolationMode\n"
        "except ImportError:\n    torchvision = io = transforms = InterpolationMode = None\n"
    )
    text = text.replace(plain, optional, 1)
    text = text.replace(
        "from torchvision import io, transforms\nfrom torchvision.transforms import InterpolationMode\n",
        "",
        1,
    )
    path.write_text(text)


def write_ov2_records(records_jsonl: Path, out: Path, system_every: int = 3) -> int:
    """The benchmark's records in OV-2's format (`messages` with role/content, `images` relative to the image
    root, an `id`); every `system_every`-th one gets a system turn. Returns the number of records."""
    from mmpack.packing.chat import normalize_record

    lines = []
    for k, line in enumerate(records_jsonl.read_text().splitlines()):
        conv = normalize_record(json.loads(line), source="bench", line=k + 1)
        messages = [{"role": r, "content": c} for r, c in conv.messages]
        if messages[0]["role"] == "assistant":  # a text record: ask for it
            messages.insert(0, {"role": "user", "content": "Write."})
        if k % system_every == 0 and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": "You are a careful visual assistant."})
        rec: dict[str, Any] = {"id": f"r{k:06d}", "messages": messages}
        if conv.images:
            rec["images"] = list(conv.images)  # relative to the image root, as in the source records
        lines.append(json.dumps(rec, ensure_ascii=False))
    out.write_text("\n".join(lines) + "\n")
    return len(lines)


def _run_measured(cmd: list[str], env: dict[str, str], log: Path) -> dict:
    """CPU s (the command and every process it waited for), wall s and peak PSS of the process tree.

    The command runs in the log's folder: the contender's stage 2 writes its own log file into the current folder.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with PeakPss(interval_s=0.2, include_self=False) as pss, open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {done.returncode}; see {log}")
    return {"cpu_s": cpu, "wall_s": wall, "peak_pss_MB": pss.peak_kb / 1024}


def _ov2_lengths(out: Path) -> dict[str, int]:
    """Record id -> token count of the samples OV-2 kept (token_info.txt names -> s1's per-sample JSON)."""
    lengths = {}
    for line in (out / "token_info.txt").read_text().splitlines():
        name, n = line.rsplit(":", 1)
        record = json.loads((out / "s1_split_json2samples" / f"{name}.json").read_text())
        lengths[record["id"]] = int(n)
    return lengths


def _mmpack_lengths(out: Path) -> dict[str, int]:
    import numpy as np

    lengths = {}
    for meta in sorted((out / "_work" / "lengths").glob("chunk-*.samples.jsonl")):
        offsets = np.load(str(meta).replace(".samples.jsonl", ".offsets.npy"))
        ids = [json.loads(x)["id"] for x in meta.read_text().splitlines()]
        lengths |= dict(zip(ids, np.diff(offsets).tolist()))
    return lengths


def _ov2_bins(out: Path, seq_len: int) -> tuple[int, int]:
    name = f"bins_{str(seq_len).replace('000', 'k')}len.pkl"
    with open(out / name, "rb") as f:
        bins = pickle.load(f)
    return len(bins), int(sum(int(b["l"].sum()) for b in bins))


def compare(
    ov2_repo: Path,
    ov2_python: str,
    records: Path,
    image_root: Path,
    model: Path,
    seq_len: int,
    workers: int,
    work: Path,
) -> dict:
    """Both pipelines on one command line (OV-2's flags; mmpack's auto_pipe.sh takes them as they are)."""
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    n_records = len(records.read_text().splitlines())
    flags = [
        "-i",
        str(records),
        "-r",
        str(image_root),
        "-m",
        str(model),
        "-L",
        str(seq_len),
        "-w",
        str(workers),
    ]
    flags += ["--direct-workers", str(workers), "--s1-num-processes", str(workers)]
    flags += ["--s2-num-processes", str(workers)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    rows: dict[str, dict] = {}
    ov2_env = {**env, "PATH": f"{Path(ov2_python).parent}:{env['PATH']}"}
    ov2_out = work / "ov2"
    ov2_cmd = ["bash", str(ov2_repo / "offline_packing" / "auto_pipe.sh"), *flags, "-o", str(ov2_out)]
    rows["LLaVA-OneVision-2"] = _run_measured(ov2_cmd, ov2_env, work / "ov2.log")
    mm_out = work / "mmpack"
    mm_cmd = [
        "bash",
        str(REPO / "offline_packing" / "auto_pipe.sh"),
        *flags,
        "-o",
        str(mm_out),
        "--no-progress",
    ]
    rows["mmpack"] = _run_measured(mm_cmd, {**env, "PYTHON": sys.executable}, work / "mmpack.log")

    ov2_len, mm_len = _ov2_lengths(ov2_out), _mmpack_lengths(mm_out)
    bins, tokens = _ov2_bins(ov2_out, seq_len)
    rows["LLaVA-OneVision-2"] |= {"bins": bins, "fill": tokens / (bins * seq_len), "kept": len(ov2_len)}
    manifest = json.loads((mm_out / "manifest.json").read_text())
    counts = manifest["counts"]
    rows["mmpack"] |= {"bins": counts["bins"], "fill": counts["tokens"] / (counts["bins"] * seq_len)}
    rows["mmpack"]["kept"] = counts["samples_packed"]
    for row in rows.values():
        row["rejected"] = n_records - row["kept"]
    same = [k for k in ov2_len if mm_len.get(k) == ov2_len[k]]
    return {
        "seq_len": seq_len,
        "records": n_records,
        "contenders": rows,
        "same_samples_kept": set(ov2_len) == set(mm_len),
        "same_token_counts": len(same),
        "differing_token_counts": sorted(
            set(ov2_len) ^ set(mm_len) | {k for k in ov2_len if k in mm_len} - set(same)
        )[:20],
    }


def print_table(result: dict) -> None:
    print(f"\n{result['records']} records, L = {result['seq_len']}")
    print(
        f"{'contender':>18} {'CPU s':>8} {'wall s':>8} {'peak PSS MiB':>12} {'bins':>6} {'fill':>7} {'rejects':>8}"
    )
    for name, r in result["contenders"].items():
        print(
            f"{name:>18} {r['cpu_s']:>8.1f} {r['wall_s']:>8.1f} {r['peak_pss_MB']:>12.0f} {r['bins']:>6} "
            f"{100 * r['fill']:>6.2f}% {r['rejected']:>8}"
        )
    print(
        f"same samples kept: {result['same_samples_kept']}; same token count: {result['same_token_counts']} of "
        f"{result['contenders']['LLaVA-OneVision-2']['kept']}"
    )


def versus_ov2(
    records_jsonl: Path,
    image_root: Path,
    tokenizer_file: Path,
    ov2_repo: Path,
    ov2_python: str,
    seq_lens: list[int],
    workers: int,
    data_dir: Path,
) -> list[dict]:
    """`compare` at each of `seq_lens` on the benchmark's records in OV-2's format; prints a table each."""
    # absolute, since each command runs in its own log folder
    image_root, ov2_repo, data_dir = image_root.resolve(), ov2_repo.resolve(), data_dir.resolve()
    make_qwen_vl_utils_importable(ov2_python)
    model = make_model_folder(data_dir / "ov2-model" / "Qwen2-VL", tokenizer_file)
    records = data_dir / "ov2-records.jsonl"
    write_ov2_records(records_jsonl, records)
    results = []
    for seq_len in seq_lens:
        result = compare(
            ov2_repo, ov2_python, records, image_root, model, seq_len, workers, data_dir / "ov2-runs"
        )
        print_table(result)
        results.append(result)
    return results
