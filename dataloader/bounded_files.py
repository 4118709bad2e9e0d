"""Reading a spec file a user hands in (a mixture file) with the limits any input gets: a regular file (not a FIFO
or a device) of bounded size in UTF-8, YAML whose aliases cannot expand without bound, and messages that show
only a short excerpt of what was read."""

from __future__ import annotations

import os
import reprlib
import stat
from typing import Any


def short_repr(value: Any) -> str:
    """`repr(value)` cut short (a few items, a few levels, short strings): what a message shows of an input."""
    r = reprlib.Repr()
    r.maxlevel, r.maxlist, r.maxtuple, r.maxdict, r.maxset = 2, 4, 4, 4, 4
    r.maxstring = r.maxother = r.maxlong = 60
    return r.repr(value)


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def read_regular_file(path: str, what: str, max_bytes: int, *, advice: str) -> str:
    """The UTF-8 text of `path`, a regular file (a FIFO would block the reader, a device never ends) of at most
    `max_bytes`; otherwise a ValueError naming `what` and `path`, ending with `advice` where it is the wrong kind."""
    try:  # O_NONBLOCK: opening a FIFO does not wait for a writer; it is refused below
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise ValueError(f"{what} {path} is {kind}; {advice}")
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{what} {path} is larger than the limit of {max_bytes} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None


def load_yaml_bounded(text: str, max_nodes: int) -> Any:
    """`yaml.safe_load(text)` with its aliases bounded: a ValueError (one line) where they expand past
    `max_nodes` nodes or refer to a node they are inside, or where `text` is not YAML."""
    import yaml

    try:
        loader = yaml.SafeLoader(text)  # reads the text: a character YAML refuses is an error here already
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            _check_expanded_size(node, max_nodes)
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        where = (
            f"line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}: " if e.problem_mark else ""
        )
        raise ValueError(" ".join(f"{where}{e.context or ''} {e.problem or ''}".split())) from None
    except yaml.YAMLError as e:
        raise ValueError(" ".join(str(e).split())) from None


def _check_expanded_size(root: Any, max_nodes: int) -> None:
    """Refuse a YAML document whose aliases expand it past `max_nodes` (each scalar counts 1 + its length) or
    refer to a node they are inside; each node is counted once, so a bomb is found without expanding it."""
    import yaml

    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: Any) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise ValueError("a YAML alias refers to a node it is inside; write the value out")
        open_nodes.add(key)
        if isinstance(node, yaml.SequenceNode):
            children = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        total = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
        for child in children:
            total += size(child)
            if total > max_nodes:
                raise ValueError(
                    f"its YAML aliases expand past {max_nodes} nodes; write the values out without aliases (*name)"
                )
        open_nodes.discard(key)
        sizes[key] = total
        return total

    size(root)
