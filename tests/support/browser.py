"""A real headless browser for the tests of `mmpack view`: Debian's chromium renders a page (its scripts run) and
hands back the DOM, which `parse_dom` turns into a small tree. Without chromium the test skips, and under CI fails
(`.ci/run` installs it)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

from tests.support.shared import skip_or_fail

BROWSERS = ("chromium", "chromium-browser")
# void elements have no end tag: they never hold children
_VOID = frozenset(
    {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}
)


def need_chromium() -> str:
    """The chromium executable; skips the test when there is none (under CI: fails)."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    skip_or_fail("needs chromium (a headless browser): apt-get install -y chromium")


def dump_dom(page: Path, profile: Path, timeout_s: float = 90, fragment: str = "") -> str:
    """The DOM of `page` (with its URL's `#fragment`) after its scripts ran (`--dump-dom`; virtual time lets its
    script loads finish)."""
    browser = need_chromium()
    cmd = [
        browser, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
        "--virtual-time-budget=20000", "--dump-dom", page.resolve().as_uri() + (f"#{fragment}" if fragment else ""),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    assert done.returncode == 0 and "<html" in done.stdout, done.stderr[-3000:]
    return done.stdout


@dataclass
class Node:
    """One element of a parsed page: tag, attributes, children and text pieces in order."""

    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def iter(self) -> list[Node]:
        """This node and every element below it, in document order."""
        out = [self]
        for c in self.children:
            if isinstance(c, Node):
                out += c.iter()
        return out

    def find_all(self, tag: str | None = None, cls: str | None = None, **attrs: str) -> list[Node]:
        return [
            n
            for n in self.iter()
            if (tag is None or n.tag == tag)
            and (cls is None or cls in n.classes)
            and all(n.attrs.get(k.replace("_", "-")) == v for k, v in attrs.items())
        ]

    def by_id(self, element_id: str) -> Node:
        found = [n for n in self.iter() if n.attrs.get("id") == element_id]
        assert len(found) == 1, f"{len(found)} elements with id {element_id!r}"
        return found[0]


class _TreeBuilder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Node("#document", {})
        self.stack = [self.root]

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in _VOID:
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        for i in range(len(self.stack) - 1, 0, -1):
            if self.stack[i].tag == tag:
                del self.stack[i:]
                return

    def handle_data(self, data: str) -> None:
        self.stack[-1].children.append(data)


def parse_dom(html: str) -> Node:
    """The element tree of a serialized DOM."""
    builder = _TreeBuilder()
    builder.feed(html)
    builder.close()
    return builder.root
