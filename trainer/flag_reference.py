"""The trainer's flag reference (docs/trainer-flags.md), written from the parser that ``pretrain_vlm`` parses with:
one table per flag group, each flag with its type or choices, its config's default, the config field it sets and
its help.

    python -m mmpack.trainer.flag_reference docs/trainer-flags.md          # write it
    python -m mmpack.trainer.flag_reference docs/trainer-flags.md --check  # exit 1 when it is stale
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mmpack.trainer.arguments import build_parser, section_configs
from mmpack.trainer.flags import FlagSpec, default_text, field_default, flag_fields, parser_flags

COMMAND = "python -m mmpack.trainer.flag_reference docs/trainer-flags.md"

HEADER = f"""# Trainer flags

<!-- Written by `{COMMAND}`
from the config fields: edit a field's flag(help=...) and run it again (tests/test_trainer_flags.py fails when
this file is stale). -->

The flags of `torchrun --nproc_per_node N -m mmpack.trainer.pretrain_vlm` (also `--help`). Each flag but the few
marked "hand-written" is a field of the run's config (`mmpack.trainer.config.RunConfig`: the *field* column) and
takes that field's default when not given; a switch is off unless given. LLaVA-OneVision-2's stage-script flags
are here under their Megatron-LM spellings.
"""


def _escape(text: str) -> str:
    """Text safe in a markdown table cell."""
    return text.replace("|", "\\|").replace("*", "\\*").replace("<", "&lt;")


def _type_text(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "switch"
    if action.choices is not None:
        return " \\| ".join(f"`{c}`" for c in action.choices)
    kind = action.type
    if kind in (int, float):
        base = kind.__name__  # type: ignore[union-attr]
    elif kind is None:
        base = "text"
    else:  # a text form of its own, which the metavar shows
        base = f"`{action.metavar}`"
    return {"+": f"{base} ...", "*": f"[{base} ...]"}.get(str(action.nargs), base)


def _row(action: argparse.Action, fields: dict[str, tuple[str, Any, FlagSpec]]) -> str:
    flags = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.default is argparse.SUPPRESS:  # a config field's flag: the config holds its default
        where, f, spec = fields[action.dest]
        default, field, help_text = default_text(field_default(f)), f"`{where}`", spec.help
    else:
        default = None if action.default in (None, False) else str(action.default)
        field, help_text = "hand-written", (action.help or "").replace("%%", "%")
    cells = [flags, _type_text(action), f"`{default}`" if default else "—", field, _escape(help_text)]
    return "| " + " | ".join(cells) + " |"


def render_reference() -> str:
    """The markdown of docs/trainer-flags.md."""
    fields = {
        f.name: (f"{section}.{f.name}", f, spec)
        for section, _, cls in section_configs()
        for f, spec in flag_fields(cls)
    }
    lines = [HEADER]
    for title, actions in parser_flags(build_parser()):
        lines += [f"## {title}", "", "| flag | type | default | field | what |", "|---|---|---|---|---|"]
        lines += [_row(a, fields) for a in actions]
        lines.append("")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mmpack.trainer.flag_reference", description=__doc__.split("\n")[0]
    )
    p.add_argument("path", nargs="?", help="the file to write (default: print it)")
    p.add_argument(
        "--check", action="store_true", help="compare with the file instead; exit 1 when it differs"
    )
    args = p.parse_args(argv)
    text = render_reference()
    if args.path is None:
        sys.stdout.write(text)
        return 0
    path = Path(args.path)
    if args.check:
        if not path.is_file() or path.read_text() != text:
            print(
                f"{path} is not the flag reference of the current configs: run `{COMMAND}`", file=sys.stderr
            )
            return 1
        return 0
    path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
