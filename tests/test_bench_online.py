"""The online-packing benchmark (`benchmarks/bench_online_vs_energon.py`) compares equal work: on a tiny input,
mmpack's online loader (of the JSONL and of the tars) and Energon's packing buffer with mmpack's rule in its task
encoder see the same samples with the same token counts (control: Energon under another image rule counts other
tokens, and the check sees it)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from benchmarks import bench_online_vs_energon as bench
from mmpack.demo.synthetic import train_tiny_bpe
from tests.support.shared import need_import

RECORDS = 40


@pytest.fixture(scope="module")
def tiny_input(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path], str]:
    need_import("megatron.energon", extra="energon")
    tmp = tmp_path_factory.mktemp("bench-online")
    tokenizer = str(train_tiny_bpe(tmp / "bpe", seed=0))
    args = bench.parse_args(["--records", str(RECORDS), "--tokenizer", tokenizer])
    tars = bench.write_raw_tars(tmp, args.records, 2, bench.SEED)
    bench.add_energon_metadata(tmp, tars)
    return tmp, tars, tokenizer


@pytest.mark.parametrize("energon_rule", ["same", "other max_pixels (control)"])
def test_online_and_energon_see_the_same_samples_and_counts(
    tiny_input: tuple[Path, list[Path], str], energon_rule: str
) -> None:
    tmp, tars, tokenizer = tiny_input
    argv = ["--records", str(RECORDS), "--buffer-size", "16", "--seq-len", "1024", "--workers", "0"]
    args = bench.parse_args([*argv, "--tokenizer", tokenizer])
    online, online_tars, energon, _ = bench.contenders(tmp, tars, tokenizer, args, trace=True)
    if energon_rule != "same":
        source = bench.open_source(tars, tokenizer, args, None)
        lengths = source.config.lengths
        smaller = replace(lengths.image_rule, max_pixels=28 * 28 * 16)
        other = replace(source, config=replace(source.config, lengths=replace(lengths, image_rule=smaller)))
        energon = bench.energon_contender(tmp, bench.PackingRule(other), args.buffer_size, 0)
    passes = []
    for contender in (online, energon) if energon_rule != "same" else (online, energon, online_tars):
        result, _, seen = bench.run_pass(contender, RECORDS, 0.9)
        assert result["samples"] == len(seen) == RECORDS
        passes.append(seen)
    differences = bench.work_differences(passes[0], passes[1])
    if energon_rule == "same":
        assert differences == []
        assert bench.work_differences(passes[0], passes[2]) == []  # the tars read by mmpack too
    else:  # the image samples count other tokens: the check sees it
        assert differences and all("tokens" in d for d in differences)
        print(f"control: {len(differences)} of {RECORDS} samples counted differently")
