"""`mmpack view`: see a packed dataset, or N raw records packed as `mmpack pack` would, as the model sees them,
in a static offline web page (`-o DIR`, then open DIR/index.html, or `--serve`).

Bad input (a missing shard, a manifest of another version, an image that does not decode) is one line
`mmpack view: problem: ...` naming the file, and the same line in the page's Problems section; the rest still
shows. A dataset that cannot be read at all is one line `mmpack view: error: ...`, exit code 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mmpack.view import POSITION_RULES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `mmpack view`."""
    parser.add_argument(
        "path", help="a packed dataset folder (holding manifest.json), or with -n a raw .json/.jsonl file"
    )
    parser.add_argument("-o", "--out", required=True, help="folder the page is written to (DIR/index.html)")
    parser.add_argument(
        "-t",
        "--tokenizer",
        help="tokenizer.json (or its folder) the dataset was packed with, to show the text (default: the byte "
        "tokenizer for byte-fallback datasets, else ids only)",
    )
    parser.add_argument("--bins", type=int, default=20, help="render the first N bins (default 20)")
    parser.add_argument(
        "--bin", type=int, action="append", default=[], metavar="K", help="also render bin K (repeatable)"
    )
    parser.add_argument(
        "--page-size", type=int, default=100, help="bins per page of the bin list (default 100)"
    )
    parser.add_argument(
        "--positions",
        choices=POSITION_RULES,
        default="auto",
        help="position rule shown on hover (default auto: the dataset's video style, else Qwen2.5-VL M-RoPE)",
    )
    parser.add_argument("--format", choices=("arrow", "wds"), help="which shards to read (default: arrow)")
    parser.add_argument("--no-plot", action="store_true", help="skip the mmpack stats figure")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    raw = parser.add_argument_group("raw records (before packing)")
    raw.add_argument(
        "-n",
        "--records",
        type=int,
        help="pack the first N records of PATH as mmpack pack would, and show them",
    )
    raw.add_argument("--model", help="model folder for the raw records (mmpack pack --model)")
    raw.add_argument(
        "-L", "--seq-len", type=int, default=4096, help="bin length for the raw records (default 4096)"
    )
    raw.add_argument("-r", "--image-root", help="folder image paths are relative to (default: PATH's folder)")
    raw.add_argument(
        "--pack-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="another mmpack pack flag for the raw records, e.g. --pack-arg=--no-default-system (repeatable)",
    )
    serve = parser.add_argument_group("serving")
    serve.add_argument(
        "--serve", action="store_true", help="serve DIR on 127.0.0.1 (renders other bins on request)"
    )
    serve.add_argument("--port", type=int, default=0, help="port for --serve (default: a free one)")


def run(args: argparse.Namespace) -> int:
    """Write the page (and serve it with --serve); returns the exit code."""
    from mmpack.packing.manifest import ManifestError
    from mmpack.view.site import ViewOptions, prepare_out, write_view

    out = Path(args.out)
    if args.bins < 0 or args.page_size < 1 or (args.records is not None and args.records < 1):
        print("mmpack view: error: --bins must be >= 0, --page-size and -n >= 1", file=sys.stderr)
        return 2
    opts = ViewOptions(
        tokenizer=args.tokenizer,
        bins=args.bins,
        extra_bins=tuple(args.bin),
        page_size=args.page_size,
        positions=args.positions,
        shard_format=args.format,
        progress=not args.no_progress,
        plot=not args.no_plot,
    )
    try:
        prepare_out(out)
        if args.records is not None or (args.model and Path(args.path).is_file()):
            from mmpack.view.raw import pack_preview

            root, tokenizer, alias = pack_preview(args, out / "_packed")
            opts.tokenizer = opts.tokenizer or tokenizer
            opts.alias = tuple(alias.items())
        else:
            root = _dataset_root(args.path)
            opts.tokenizer = opts.tokenizer or args.model  # a model folder holds its tokenizer.json
        report = write_view(root, out, opts, say=lambda line: print(line, file=sys.stderr))
    except (ManifestError, OSError, ValueError) as e:
        print(f"mmpack view: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    index = (out / "index.html").resolve()
    print(
        f"mmpack view: wrote {index} ({len(report.bins_rendered)} bins rendered, {len(report.problems)} problems, "
        f"first page in {report.first_page_s:.2f} s, all in {report.total_s:.2f} s)"
    )
    if args.serve:
        from mmpack.view.serve import serve

        return serve(out, root, opts, args.port)
    return 0


def _dataset_root(path: str) -> Path:
    """The dataset folder of PATH (a folder or its manifest.json); local paths only."""
    if "://" in path and not path.startswith("file://"):
        raise ValueError(f"{path}: mmpack view reads local datasets; copy it here first (e.g. aws s3 sync)")
    p = Path(path.removeprefix("file://"))
    if p.name == "manifest.json":
        p = p.parent
    if not (p / "manifest.json").is_file():
        raise FileNotFoundError(f"{p}: no manifest.json: not a packed dataset (for raw records give -n N)")
    return p
