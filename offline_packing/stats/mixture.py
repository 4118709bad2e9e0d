"""`mmpack stats --mixture SPEC`: the stats of every source of a mixture and of the blended stream.

SPEC is a mixture file (YAML/JSON, `mmpack.dataloader.mixture.load_mixture_file`) or Megatron's inline form
(`'0.7 /data/a 0.3 s3://b/c'`). Each source gets the report of a dataset (`mmpack stats PATH`); the blend
is what the loader serves: a bin of source k with probability its share, so its fill, tokens and samples per
bin are the share-weighted means of the sources' (`shares` as the loader computes them). Sources the loader
would not mix (`mmpack.dataloader.mixture.check_sources`) are refused with its message; each source's report
counts its images by its own image rule.
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Callable
from typing import Any

import numpy as np


def read_mixture(spec: str) -> Any:
    """The `Mixture` of a file (anything at that path, or a name ending in .yaml / .yml / .json: a FIFO or a
    missing file is refused naming it) or an inline spec."""
    from mmpack.dataloader.mixture import load_mixture_file, parse_inline

    is_file = os.path.lexists(spec) or spec.endswith((".yaml", ".yml", ".json"))
    return load_mixture_file(spec) if is_file else parse_inline(spec)


def mixture_report(
    args: argparse.Namespace,
    dataset_report: Callable[[argparse.Namespace, dict[str, Any]], tuple[dict, np.ndarray, np.ndarray]],
    storage_options: Callable[[str], dict[str, Any]],
) -> dict[str, Any]:
    """{"sources": [{name, path, share, report}], "blended": {...}} of the mixture `args.mixture`."""
    from mmpack.dataloader.manifest import load_manifest
    from mmpack.dataloader.mixture import check_sources

    mixture = read_mixture(args.mixture)
    reports, manifests = [], []
    for source in mixture.sources:
        if source.kind == "raw":
            raise ValueError(f"mixture source {source.path!r} is raw records (kind: raw): `mmpack stats` reads packed datasets; the trainer packs raw ones as it loads them")  # fmt: skip
        one = copy.copy(args)
        one.path = source.path
        options = storage_options(source.path) | (source.storage_options or {})
        reports.append(dataset_report(one, options)[0])
        manifests.append(load_manifest(source.path, storage_options=options))
    check_sources(mixture.names, manifests)  # what the loader refuses, each source's own pixel rule kept
    bins = [r["num_bins"] for r in reports]
    shares = mixture.shares(bins)
    sources = [
        {"name": n, "path": s.path, "share": share, "report": r}
        for n, s, share, r in zip(mixture.names, mixture.sources, shares, reports)
    ]
    per_bin_tokens = [r["total_tokens"] / r["num_bins"] for r in reports]
    per_bin_samples = [r["num_samples"] / r["num_bins"] for r in reports]
    blended = {
        "bins_per_epoch": mixture.epoch_bins(bins),
        "fill_efficiency": float(np.dot(shares, [r["fill_efficiency"] for r in reports])),
        "tokens_per_bin": float(np.dot(shares, per_bin_tokens)),
        "samples_per_bin": float(np.dot(shares, per_bin_samples)),
        "token_share": {
            n: float(s * t / np.dot(shares, per_bin_tokens))
            for n, s, t in zip(mixture.names, shares, per_bin_tokens)
        },
    }
    return {"sources": sources, "blended": blended}


def print_mixture_report(console: Any, report: dict[str, Any], max_shard_rows: int) -> None:
    """Each source's tables, then one table of the blend."""
    from rich.table import Table

    from mmpack.offline_packing.stats.report import print_report

    for source in report["sources"]:
        console.rule(f"source {source['name']} ({source['path']}), share {source['share']:.3f}")
        print_report(console, source["report"], max_shard_rows)
    table = Table(title="blended stream (what the loader serves)")
    table.add_column("source")
    table.add_column("share of bins", justify="right")
    table.add_column("share of tokens", justify="right")
    table.add_column("fill", justify="right")
    for source in report["sources"]:
        name = source["name"]
        table.add_row(
            name,
            f"{source['share']:.3f}",
            f"{report['blended']['token_share'][name]:.3f}",
            f"{source['report']['fill_efficiency']:.3f}",
        )
    b = report["blended"]
    table.add_row("blend", "1.000", "1.000", f"{b['fill_efficiency']:.3f}")
    console.print(table)
    console.print(
        f"bins per epoch of the mixture: {b['bins_per_epoch']}, tokens per bin {b['tokens_per_bin']:.1f}, "
        f"samples per bin {b['samples_per_bin']:.2f}"
    )
