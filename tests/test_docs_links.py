"""The documentation holds together: every relative link between README.md and docs/*.md (and every #anchor)
resolves, and README.md stays a front door. Each check has a control."""

from __future__ import annotations

from pathlib import Path

from tests.support.doc_links import anchors, broken_links, links, pages, slug

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 300


def test_every_relative_link_resolves() -> None:
    broken, checked = broken_links(ROOT)
    assert len(pages(ROOT)) > 5 and checked > 40  # the pages were read and their links found
    assert broken == []


def test_control_a_planted_broken_link_fails(tmp_path: Path) -> None:
    """Control: a link to a missing page, to a missing heading, or to a missing heading of the page itself is
    found; good links, external links and links inside code are not reported."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "# Front door\n\n"
        "[guide](docs/guide.md), [its part](docs/guide.md#part-two-mmpack-pack), [self](#front-door)\n"
        "[gone](docs/gone.md) and [no part](docs/guide.md#part-three)\n"
        "[web](https://example.com/x.md) `[code](docs/nowhere.md)`\n"
        "```bash\n[fenced](docs/nowhere.md)\n```\n"
        "[ref]: docs/missing-ref.md\n"
    )
    (tmp_path / "docs" / "guide.md").write_text(
        "# Guide\n\n## Part two: `mmpack pack`\n\n[back](../README.md#front-door) [bad self](#part-one)\n"
    )
    broken, checked = broken_links(tmp_path)
    assert broken == [
        "README.md:4: docs/gone.md (no such file)",
        "README.md:4: docs/guide.md#part-three (no heading #part-three in guide.md)",
        "README.md:9: docs/missing-ref.md (no such file)",
        "docs/guide.md:5: #part-one (no heading #part-one in guide.md)",
    ]
    assert checked == 8


def test_heading_ids_follow_github() -> None:
    title = "Packing a dataset: `mmpack pack` and `auto_pipe.sh`"
    assert slug(title) == "packing-a-dataset-mmpack-pack-and-auto_pipesh"
    assert slug("Compute balancing: `python benchmarks/bench_balance.py --measure`") == (
        "compute-balancing-python-benchmarksbench_balancepy---measure"
    )
    assert slug("LLaVA-OneVision-2's stage scripts") == "llava-onevision-2s-stage-scripts"
    text = "# A\n## Notes\n```\n# not a heading\n```\n## Notes\n"
    # control: a repeated heading gets -1, a fenced line is no heading
    assert anchors(text) == {"a", "notes", "notes-1"}
    assert links("see [a](b.md) and `[c](d.md)`\n") == [(1, "b.md")]


def _too_long(text: str) -> str | None:
    lines = text.count("\n")
    if lines <= README_MAX_LINES:
        return None
    return f"README.md has {lines} lines: move guides and reference into docs/"


def test_readme_is_a_front_door() -> None:
    assert _too_long((ROOT / "README.md").read_text()) is None
    assert _too_long("line\n" * README_MAX_LINES) is None
    assert _too_long("line\n" * (README_MAX_LINES + 1)) == (  # control: one line more is refused
        "README.md has 301 lines: move guides and reference into docs/"
    )
