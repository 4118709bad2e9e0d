"""`mmpack view`: see a packed dataset (local, in object storage or over HTTP, or a mixture), or N raw records
packed as `mmpack pack` would (also `mmpack pack ... --preview N`), as the model sees them, in a static offline
web page (`-o DIR`, then open DIR/index.html, or `--serve`).

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
        "path",
        nargs="+",
        help="a packed dataset: a folder holding manifest.json, or its URL (s3://, http(s)://); a mixture file "
        "(YAML/JSON, as --data-mixture takes); or with -n raw records as mmpack pack -i takes them (files, "
        "folders, globs, URLs: .json/.jsonl(.gz), .parquet, WebDataset .tar; several)",
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
    parser.add_argument("--s3-endpoint", help="endpoint URL for s3:// datasets (or AWS_ENDPOINT_URL)")
    parser.add_argument(
        "--cache-dir",
        help="where remote shards are fetched to (default: the loader's cache in the temp folder)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    raw = parser.add_argument_group("raw records (before packing)")
    raw.add_argument(
        "-n",
        "--records",
        type=int,
        help="pack the first N records of PATH... as mmpack pack would (in its order), and show them",
    )
    raw.add_argument("--model", help="model folder for the raw records (mmpack pack --model)")
    raw.add_argument(
        "-L", "--seq-len", type=int, default=4096, help="bin length for the raw records (default 4096)"
    )
    raw.add_argument(
        "-r", "--image-root", help="folder image paths are relative to (default: the raw files' folder)"
    )
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
    from mmpack.view.sources import local_dataset

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
        if _is_raw(args):
            from mmpack.view.raw import pack_preview

            root, tokenizer, alias = pack_preview(args, out / "_packed")
            opts.tokenizer = opts.tokenizer or tokenizer
            opts.alias = tuple(alias.items())
        else:
            if len(args.path) > 1:
                raise ValueError(f"{' '.join(args.path)}: one packed dataset or mixture at a time (or -n N)")
            fetch_problems: list[str] = []
            dataset = local_dataset(
                args.path[0],
                out,
                storage_options={"endpoint_url": args.s3_endpoint} if args.s3_endpoint else None,
                shard_format=args.format,
                cache_dir=args.cache_dir,
                problems=fetch_problems,
                say=lambda line: print(line, file=sys.stderr),
            )
            root = dataset.root
            opts.dataset, opts.fetch_problems = dataset, tuple(fetch_problems)
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


def _is_raw(args: argparse.Namespace) -> bool:
    """Raw records to preview: -n given, or --model with raw input files (not a dataset nor a mixture)."""
    from mmpack.offline_packing.inputs.sources import is_input_file

    if args.records is not None:
        return True
    return bool(args.model) and (len(args.path) > 1 or is_input_file(args.path[0]))


def run_pack_preview(job: argparse.Namespace) -> int:
    """`mmpack pack ... --preview N`: the first N records of the job's inputs (in the job's order), packed with the
    job's flags and shown as `mmpack view RAW -n N` shows them, in OUTPUT.preview/index.html; nothing else is
    packed."""
    from mmpack.packing.tokenizer import BYTE_TOKENIZER

    if job.preview < 1:
        print("mmpack pack: error: --preview N needs N >= 1 (the number of records shown)", file=sys.stderr)
        return 2
    output = str(job.output).rstrip("/")
    page = output if "://" not in output else output.rsplit("/", 1)[-1]  # a URL output: a local page
    argv = [*job.inputs, "-o", page + ".preview", "-n", str(job.preview), "-L", str(job.seq_len)]
    argv += ["-r", job.image_root] if getattr(job, "image_root", None) else []
    argv += ["--model", job.model] if getattr(job, "model", None) else []
    tokenizer = getattr(job, "tokenizer", None)
    argv += ["-t", tokenizer] if tokenizer and tokenizer != BYTE_TOKENIZER else []
    argv += [] if getattr(job, "progress", True) else ["--no-progress"]
    parser = argparse.ArgumentParser(prog="mmpack pack --preview")
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.pack_job = job
    return run(args)
