"""`mmpack pack`: flags (mmpack.offline_packing.flags) -> PackJobConfig -> run_pack, failures as one line."""

from __future__ import annotations

import argparse
import sys

from mmpack.offline_packing.flags import add_arguments as add_arguments
from mmpack.offline_packing.flags import config_from_args


def run(args: argparse.Namespace) -> int:
    """Run the job; prints the summary to stderr. Exit code 0 on success, 1 on a job error, 2 on bad flags."""
    from mmpack.offline_packing.pipeline import run_pack_reporting

    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"mmpack pack: error: {exc}", file=sys.stderr)
        return 2
    return run_pack_reporting(cfg, "mmpack pack")


def main(argv: list[str] | None = None) -> int:
    """`mmpack pack ARGS` without the `mmpack` dispatcher: `python -m mmpack.offline_packing ARGS`."""
    parser = argparse.ArgumentParser(
        prog="mmpack pack", description="pack raw multimodal samples into a sharded packed dataset"
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
