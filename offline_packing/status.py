"""`python -m mmpack.offline_packing.status -o OUT`: what each stage of a packing job into OUT has done
(`auto_pipe.sh -s`), read from the work folder's markers and the dataset's manifest; changes nothing.

A stage shows DONE when its marker is there (its options and inputs are checked only by a run: a changed
option redoes it then), else TODO with the chunks or shards it finished so far.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from mmpack.offline_packing.config import STAGES
from mmpack.packing.format import MANIFEST_NAME

_WHAT = {
    "scan": "read the records and image headers",
    "lengths": "token ids and length of every sample",
    "binpack": "bin of every sample",
    "write": "shards, manifest.json, rejects.jsonl, stats.json",
}


def _detail(stage: str, marker: dict, output: Path) -> str:
    if stage == "scan":
        return f"{sum(marker.get('accepted', []))} samples kept, {marker.get('rejected', 0)} rejected"
    if stage == "lengths":
        return f"{sum(marker.get('accepted', []))} samples kept, {marker.get('rejected', 0)} rejected"
    if stage == "binpack":
        return f"{marker.get('bins', 0)} bins, {marker.get('tokens', 0)} tokens ({marker.get('algorithm')})"
    manifest = output / MANIFEST_NAME
    if not manifest.is_file():
        return "manifest.json missing: the next run rewrites the dataset"
    counts = json.loads(manifest.read_text()).get("counts", {})
    return f"{counts.get('bins', 0)} bins, {counts.get('samples_packed', 0)} samples packed"


def format_status(output: str, work_dir: str) -> str:
    """One block per stage: DONE (when, what it holds) or TODO (chunks done so far), and where its files are."""
    root, out = Path(work_dir), Path(output)
    lines = [f"Pipeline status: {output}", f"  work folder: {work_dir}", ""]
    for n, stage in enumerate(STAGES, start=1):
        marker = root / f"{stage}.done.json"
        if marker.is_file():
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(marker.stat().st_mtime))
            state = f"[DONE] {when}: {_detail(stage, json.loads(marker.read_text()), out)}"
        else:
            parts = len(list((root / stage).glob("*.done.json"))) + len(
                list((root / stage).glob("shard-*.json"))
            )
            state = (
                f"[TODO] not completed ({parts} chunks or shards finished)" if parts else "[TODO] not started"
            )
        where = out if stage == "write" else root / stage
        lines += [f"  Step {n} ({stage}: {_WHAT[stage]})", f"      {state}", f"      output: {where}", ""]
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """Print the status of the job into `-o`; exit code 0."""
    from mmpack.offline_packing.pipeline import work_dir_of

    p = argparse.ArgumentParser(prog="python -m mmpack.offline_packing.status", description=__doc__)
    p.add_argument("-o", "--output", required=True, help="the job's output folder")
    p.add_argument("--work-dir", default=None, help="the job's --work-dir, if it had one")
    args = p.parse_args(argv)
    print(format_status(args.output, work_dir_of(args.output, args.work_dir)), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
