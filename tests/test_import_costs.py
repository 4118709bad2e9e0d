"""What importing a part loads, seen in `sys.modules` of a fresh interpreter: the micro-batch contract
(`mmpack.packing.batch`, imported by every loader worker and rank) loads neither numba nor torch, the loader
loads no numba; numba comes with the bin-packing kernels only (the control: importing them does load it)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow  # one subprocess that imports torch (through the loader)

PROBE = textwrap.dedent(
    """
    import json, sys
    seen = {}
    def loaded(step, module):
        __import__(module)
        seen[step] = sorted(m for m in ("numba", "torch") if m in sys.modules)
    loaded("batch", "mmpack.packing.batch")
    loaded("layout", "mmpack.packing.layout")
    loaded("dataloader", "mmpack.dataloader")
    loaded("binpack", "mmpack.packing.binpack")
    print(json.dumps(seen))
    """
)


def test_numba_loads_only_with_the_kernels() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["batch"] == [] and seen["layout"] == []
    assert seen["dataloader"] == ["torch"]  # the loader's consumer side is torch, and no numba
    assert seen["binpack"] == ["numba", "torch"]  # control: the kernels do load numba, and the probe sees it
