"""The `mmpack` console script: dispatches to one module per subcommand.

The application layer, above the four parts: it may import any of them, and none of them imports it. Each
subcommand module exposes `add_arguments(parser)` and `run(args) -> int` (the exit code). Only the chosen
subcommand's module is imported (by its name in `SUBCOMMANDS`), so that `mmpack stats` does not pay for
importing the packer or `mmpack pack` for torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "pack": ("mmpack.offline_packing.pack_cli", "pack raw multimodal samples into a sharded packed dataset"),
    "stats": ("mmpack.offline_packing.stats.cli", "packing efficiency of a packed dataset or a length file"),
    "view": ("mmpack.view.cli", "see a packed dataset (or raw records) as the model sees it, in a web page"),
    "demo": ("mmpack.demo.cli", "build a small dataset, pack it, print stats, train a tiny model"),
    "convert": (
        "mmpack.trainer.convert",
        "convert model checkpoints: HuggingFace <-> megatron-core (TP x PP)",
    ),
}


def build_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, ModuleType | None]:
    """Build the top-level parser; only the chosen subcommand's module is imported."""
    parser = argparse.ArgumentParser(
        prog="mmpack", description="mmpack: packing for vision-language training"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    module = None
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(sp)
    return parser, module


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mmpack` script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, module = build_parser(argv)
    args = parser.parse_args(argv)
    if module is None:
        parser.print_help()
        return 2
    if args.command == "pack" and getattr(args, "preview", None) is not None:
        from mmpack.view.cli import run_pack_preview  # the packer does not import the view: shown from here

        return run_pack_preview(args)
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
