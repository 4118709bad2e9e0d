"""`mmpack stats PATH`: packing efficiency of a packed dataset or of a length file.

PATH is a packed dataset (folder or URL holding manifest.json; only metadata is read) or a length file
(see `mmpack.offline_packing.stats.inputs`), which is packed first with `--capacity` and the packing flags.
Prints rich tables, or with `--json` the dict of `mmpack.packing.stats.packing_stats` plus `source`,
`length_distribution`, `dataset` (datasets only) and `compare` (with `--compare`). Every failure is one line
`mmpack stats: error: ...` on stderr naming the file (and line), exit code 1; flags that do not fit exit with
code 2; `--debug` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from typing import Any

import numpy as np

from mmpack.offline_packing.errors import describe_failure
from mmpack.offline_packing.stats.dataset import is_dataset_path, read_dataset
from mmpack.offline_packing.stats.inputs import (
    LENGTH_FILE_SUFFIXES,
    StatsInputError,
    StatsUsageError,
    read_length_file,
)
from mmpack.offline_packing.stats.mixture import mixture_report, print_mixture_report
from mmpack.packing.fileio import resolve_storage_options
from mmpack.packing.stats import packing_stats

EXIT_FAILURE = 1
EXIT_USAGE = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `mmpack stats`."""
    parser.add_argument(
        "path",
        nargs="?",
        help="packed dataset (folder or URL with manifest.json) or a length file: "
        f"{', '.join(LENGTH_FILE_SUFFIXES)} (name:len lines, integers, JSON list, "
        "histogram JSON {max_len, counts}, .npy)",
    )
    parser.add_argument(
        "--mixture",
        metavar="SPEC",
        help="a mixture instead of PATH: a YAML/JSON mixture file or '0.7 /data/a 0.3 s3://b/c'; reports each "
        "source and the blended stream",
    )
    pack = parser.add_argument_group("packing a length file (for a dataset: used by --compare only)")
    pack.add_argument(
        "--capacity",
        type=int,
        help="tokens per bin (required for a length file; default for a dataset: its seq_len)",
    )
    pack.add_argument("--algorithm", default="auto", help="bin-packing algorithm (default: auto)")
    pack.add_argument("--max-samples-per-bin", type=int, help="at most this many samples per bin")
    pack.add_argument(
        "--max-images-per-bin",
        type=int,
        help="at most this many images per bin (needs image counts in the input)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the stats as JSON instead of tables")
    out.add_argument("--plot", metavar="FILE.png", help="write length distribution, fill and samples per bin")
    out.add_argument(
        "--compare",
        action="store_true",
        help="pack the same lengths with every algorithm (and the caps given) and compare",
    )
    out.add_argument("--max-shard-rows", type=int, default=20, help="shards listed in the table (default 20)")
    store = parser.add_argument_group("datasets and storage")
    store.add_argument(
        "--format", choices=("arrow", "wds"), help="which shards to read (default: arrow if present)"
    )
    store.add_argument(
        "--endpoint-url",
        default=None,
        help="S3 endpoint for s3:// paths (default: $AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL)",
    )
    store.add_argument(
        "--storage-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="fsspec storage option (repeatable; VALUE parsed as JSON when it can be)",
    )
    store.add_argument(
        "--workers", type=int, default=8, help="shards read in parallel (default 8; at most one per CPU)"
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")


def run(args: argparse.Namespace) -> int:
    """Compute and print the stats; returns the exit code (1 on a failure, 2 on flags that do not fit)."""
    lengths = bin_ids = np.zeros(0, dtype=np.int64)
    try:
        _validate(args)
        if args.mixture or not args.path:
            report = _mixture_report(args)
        else:
            report, lengths, bin_ids = build_report(args, _storage_options(args))
    except Exception as e:
        if args.debug:
            traceback.print_exc()
        if isinstance(e, StatsInputError):
            message = e.message
        elif isinstance(e, _storage_errors()):  # storage unreachable, no permission, ...
            message = f"cannot read {args.path or args.mixture}: {e}"
        else:
            message = describe_failure(e)
        print(f"mmpack stats: error: {message}", file=sys.stderr)
        return EXIT_USAGE if isinstance(e, StatsUsageError) else EXIT_FAILURE
    if args.json:
        print(json.dumps(report, indent=2, default=_to_json))
    else:
        from rich.console import Console

        from mmpack.offline_packing.stats.report import print_report

        show = print_mixture_report if args.mixture else print_report
        show(Console(width=None if sys.stdout.isatty() else 120), report, args.max_shard_rows)
    if args.plot:
        from mmpack.offline_packing.stats.plot import plot_packing

        out = plot_packing(args.plot, lengths, bin_ids, report, title=str(report["source"]["path"]))
        print(f"mmpack stats: wrote {out}", file=sys.stderr)
    return 0


def _mixture_report(args: argparse.Namespace) -> dict[str, Any]:
    """`--mixture SPEC`: every source's report and the blend's."""
    if not args.mixture or args.path:
        raise StatsUsageError("give a PATH or --mixture SPEC (one of them)")
    if args.plot or args.compare:
        raise StatsUsageError("--plot and --compare take one dataset (PATH), not a --mixture")
    try:
        return mixture_report(args, _dataset_report, lambda path: _storage_options(args, path))
    except ValueError as e:  # the spec itself
        raise StatsInputError(f"mixture {args.mixture!r}: {e}") from e


def _storage_errors() -> tuple[type[BaseException], ...]:
    """OSError plus the errors of the S3/HTTP client libraries that fsspec lets through."""
    errors: list[type[BaseException]] = [OSError]
    try:
        from botocore.exceptions import BotoCoreError, ClientError

        errors += [BotoCoreError, ClientError]
    except ImportError:  # pragma: no cover - s3fs not installed
        pass
    try:
        from aiohttp import ClientError as HttpClientError

        errors.append(HttpClientError)
    except ImportError:  # pragma: no cover - no HTTP support installed
        pass
    return tuple(errors)


def _validate(args: argparse.Namespace) -> None:
    for flag in ("capacity", "max_samples_per_bin", "workers"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise StatsUsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.max_images_per_bin is not None and args.max_images_per_bin < 0:
        raise StatsUsageError(f"--max-images-per-bin must be >= 0, got {args.max_images_per_bin}")
    if args.plot and not args.plot.lower().endswith(".png"):
        raise StatsUsageError(f"--plot writes a PNG file; give a name ending in .png, got {args.plot!r}")


def _storage_options(args: argparse.Namespace, path: str | None = None) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise StatsUsageError(f"--storage-option expects KEY=VALUE, got {item!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    if args.endpoint_url:
        options.setdefault("endpoint_url", args.endpoint_url)
    return resolve_storage_options(path or args.path, options)


def build_report(
    args: argparse.Namespace, storage_options: dict[str, Any]
) -> tuple[dict, np.ndarray, np.ndarray]:
    """The stats dict of PATH, with the per-sample lengths and bin ids it was computed from."""
    if is_dataset_path(args.path, storage_options):
        return _dataset_report(args, storage_options)
    return _length_file_report(args, storage_options)


def _length_file_report(
    args: argparse.Namespace, storage_options: dict[str, Any]
) -> tuple[dict, np.ndarray, np.ndarray]:
    from mmpack.offline_packing.stats.compare import caps_bound_field
    from mmpack.offline_packing.stats.report import length_distribution
    from mmpack.packing.binpack import pack_lengths

    if args.capacity is None:
        raise StatsUsageError(f"{args.path}: a length file needs --capacity (tokens per bin) to be packed")
    data = read_length_file(args.path, storage_options)
    if args.max_images_per_bin is not None and data.image_counts is None:
        raise StatsUsageError(
            f"{args.path}: --max-images-per-bin needs image counts; give a .json {{'lengths': [...], "
            "'image_counts': [...]}} or an [N, 2] .npy"
        )
    try:
        result = pack_lengths(
            data.lengths,
            args.capacity,
            algorithm=args.algorithm,
            max_items_per_bin=args.max_samples_per_bin,
            image_counts=data.image_counts,
            max_images_per_bin=args.max_images_per_bin,
        )
    except ValueError as e:
        raise StatsInputError(f"{args.path}: cannot pack: {e}") from e
    report = dict(packing_stats(data.lengths, result.bin_ids, args.capacity, image_counts=data.image_counts))
    report["source"] = {
        "path": args.path,
        "kind": data.kind,
        "algorithm": str(result.algorithm),
        "requested_algorithm": args.algorithm,
        "max_samples_per_bin": args.max_samples_per_bin,
        "max_images_per_bin": args.max_images_per_bin,
    }
    report["source"] |= caps_bound_field(
        data.lengths,
        args.capacity,
        data.image_counts,
        args.max_samples_per_bin,
        args.max_images_per_bin,
    )
    report["length_distribution"] = length_distribution(data.lengths, args.capacity)
    if args.compare:
        report["compare"] = _compare(args, data.lengths, args.capacity, data.image_counts)
    return report, data.lengths, result.bin_ids


def _dataset_report(
    args: argparse.Namespace, storage_options: dict[str, Any]
) -> tuple[dict, np.ndarray, np.ndarray]:
    from mmpack.offline_packing.stats.compare import caps_bound_field
    from mmpack.offline_packing.stats.report import dataset_fields, length_distribution

    data = read_dataset(args.path, storage_options, fmt=args.format, workers=args.workers)
    lengths, bin_ids, images = data.lengths, data.bin_ids, data.image_counts
    if lengths.size == 0:
        raise StatsInputError(f"{data.url}: the dataset holds no samples")
    report = dict(packing_stats(lengths, bin_ids, data.capacity, image_counts=images))
    algorithm = data.manifest.get("algorithm") or {}
    if not isinstance(algorithm, dict):  # a manifest may name the algorithm only
        algorithm = {"name": algorithm}
    report["source"] = {"path": data.url, "kind": "dataset", "algorithm": algorithm.get("name")}
    report["source"] |= caps_bound_field(
        lengths,
        data.capacity,
        images,
        algorithm.get("max_items_per_bin"),
        algorithm.get("max_images_per_bin"),
    )
    report["length_distribution"] = length_distribution(lengths, data.capacity)
    report["dataset"] = dataset_fields(data)
    if args.compare:
        if args.max_images_per_bin is not None:
            raise StatsUsageError(
                f"{data.url}: --compare --max-images-per-bin is not available for a packed dataset: its shards "
                "record images per bin, not per sample; use a length file with image counts"
            )
        capacity = args.capacity or data.capacity
        # the dataset's own sample cap, so that its packing is compared like for like
        own_cap = algorithm.get("max_items_per_bin")
        rows = _compare(args, lengths, capacity, None, default_caps=(own_cap, None))
        if capacity == data.capacity:
            rows.insert(0, _as_packed_row(report))
        report["compare"] = rows
    return report, lengths, bin_ids


def _compare(
    args: argparse.Namespace,
    lengths: np.ndarray,
    capacity: int,
    images: np.ndarray | None,
    default_caps: tuple[int | None, int | None] = (None, None),
) -> list[dict]:
    """Rows without caps, then with the caps given on the command line (or `default_caps`)."""
    from mmpack.offline_packing.stats.compare import compare_algorithms

    caps = (args.max_samples_per_bin, args.max_images_per_bin)
    if caps == (None, None):
        caps = default_caps
    if caps[1] is not None and images is None:
        raise StatsUsageError(f"{args.path}: --max-images-per-bin needs per-sample image counts in the input")
    settings: list[tuple[int | None, int | None]] = [(None, None)]
    if caps != (None, None):
        settings.append(caps)
    return compare_algorithms(lengths, capacity, image_counts=images, cap_settings=settings)


def _as_packed_row(report: dict) -> dict:
    from mmpack.offline_packing.stats.compare import result_columns

    algorithm = report["dataset"].get("algorithm") or {}
    caps = algorithm if isinstance(algorithm, dict) else {}
    row = {
        "algorithm": "as packed",
        "max_samples_per_bin": caps.get("max_items_per_bin"),
        "max_images_per_bin": caps.get("max_images_per_bin"),
        **result_columns(
            int(report["num_bins"]),
            float(report["fill_efficiency"]),
            int(report["l2_lower_bound_bins"]),
            None,
        ),
    }
    if "caps_lower_bound_bins" in report["source"]:
        row["caps_lower_bound_bins"] = report["source"]["caps_lower_bound_bins"]
    return row


def _to_json(value: Any) -> Any:
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serializable: {type(value).__name__}")
