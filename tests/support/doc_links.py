"""The relative links of the project's Markdown pages (README.md and docs/*.md): every one must name a file that
exists and, with ``#anchor``, a heading of that page (GitHub's heading ids). Links inside code are not links."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages(root: Path) -> list[Path]:
    """README.md and every Markdown page under docs/ of the repository at ``root``."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose_lines(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the lines outside fenced code blocks, code spans blanked."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        opening = _FENCE.match(line)
        if opening:
            if not fence:
                fence = opening.group(1)
            elif opening.group(1) == fence:
                fence = ""
            continue
        if not fence:
            yield number, _CODE_SPAN.sub(lambda m: "x" * len(m.group(0)), line)


def slug(heading: str) -> str:
    """GitHub's id of a heading: lower case, punctuation dropped (word characters, hyphens and spaces kept),
    spaces made hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The ids of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    ids: set[str] = set()
    fence = ""
    for line in text.splitlines():
        opening = _FENCE.match(line)
        if opening:
            fence = "" if fence == opening.group(1) else fence or opening.group(1)
            continue
        match = None if fence else _HEADING.match(line)
        if match:
            base = slug(match.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            ids.add(base if n == 0 else f"{base}-{n}")
    return ids


def links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every inline or reference-style link outside code."""
    found: list[tuple[int, str]] = []
    for number, line in _prose_lines(text):
        found += [(number, m.group(1)) for m in _INLINE_LINK.finditer(line)]
        reference = _REFERENCE.match(line)
        if reference:
            found.append((number, reference.group(1)))
    return found


def broken_links(root: Path, files: list[Path] | None = None) -> tuple[list[str], int]:
    """The relative links of ``files`` (default: ``pages(root)``) whose file or anchor does not exist, as
    ``page:line: target (why)``, and how many relative links were checked."""
    broken: list[str] = []
    checked = 0
    for page in files if files is not None else pages(root):
        for number, target in links(page.read_text()):
            if _SCHEME.match(target):
                continue  # http(s), mailto: not a file of the project
            checked += 1
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(root)}:{number}: {target}"
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{where} (no heading #{anchor} in {dest.name})")
    return broken, checked
