"""Run by .ci/plain_install.sh with the wheel's own interpreter, in a folder outside the repository: every part
of mmpack imports from the installed wheel (not from a checkout), and so does every module but those that
need an extra."""

from __future__ import annotations

import importlib
import pkgutil
import sys
from pathlib import Path

PARTS = (
    "mmpack.packing",
    "mmpack.offline_packing",
    "mmpack.dataloader",
    "mmpack.trainer",
    "mmpack.trainer.pretrain_vlm",
    "mmpack.cli",  # the application layer above the four: the `mmpack` command and its demo
    "mmpack.demo.cli",
)
# modules that need an extra (README's extras) and are only imported when it is installed
NEEDS_EXTRA = {"mmpack.offline_packing.outputs.energon_sample": "energon"}


def main() -> int:
    import mmpack

    where = Path(mmpack.__file__).resolve()
    if "site-packages" not in where.parts:
        print(f"mmpack imported from {where}, not from the installed wheel")
        return 1
    for name in PARTS:
        importlib.import_module(name)
    names = sorted(m.name for m in pkgutil.walk_packages(mmpack.__path__, "mmpack."))
    failed = {}
    tried = [n for n in names if n not in NEEDS_EXTRA and not n.endswith(".__main__")]
    for name in tried:
        try:
            importlib.import_module(name)
        except Exception as e:  # every failure, named
            failed[name] = f"{type(e).__name__}: {e}"
    for name, error in failed.items():
        print(f"cannot import {name}: {error}")
    print(
        f"{len(tried) - len(failed)} of {len(tried)} modules import from the wheel at {where.parent} "
        f"(not tried: {len(names) - len(tried)}, __main__ or needing an extra)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
