"""Every output byte of a set of packing jobs (`tests.support.golden_pack`) equals what was recorded in
`tests/golden/pack_sha256.json`: shards, manifest, rejects, stats and Energon metadata."""

from __future__ import annotations

import itertools
import json

import pytest

from tests.support.golden_pack import GOLDEN_FILE, run_jobs, shared_data

pytestmark = pytest.mark.slow  # several small packing jobs, ~10 s of CPU


def test_outputs_equal_the_recorded_ones() -> None:
    golden = json.loads(GOLDEN_FILE.read_text())
    got = run_jobs()
    expected = golden if shared_data() is not None else {k: golden[k] for k in got}
    assert sorted(got) == sorted(expected)
    for name, files in expected.items():
        assert got[name] == files, f"job {name}: outputs differ from {GOLDEN_FILE.name}"
    # control: every job's options differ, and so does its manifest, so the comparison can fail
    for (a, fa), (b, fb) in itertools.combinations(got.items(), 2):
        assert fa["manifest.json"] != fb["manifest.json"], (a, b)
