"""`mmpack view --serve`: the report folder over HTTP on 127.0.0.1 (stdlib `http.server`); a bin the folder does
not hold yet is rendered when the page asks for it."""

from __future__ import annotations

import functools
import json
import re
import threading
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mmpack.dataloader.manifest import Manifest
from mmpack.view.site import BinRenderer, ViewOptions

_BIN_PATH = re.compile(r"^/bin/b(\d{9})\.js$")


class _Handler(SimpleHTTPRequestHandler):
    renderer: BinRenderer
    lock: threading.Lock

    def do_GET(self) -> None:
        match = _BIN_PATH.match(self.path.split("?", 1)[0])
        if match and not (Path(self.directory) / self.path.lstrip("/")).is_file():
            with self.lock:  # one render at a time: the shard readers are shared
                self.renderer.render(int(match.group(1)))
        super().do_GET()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@dataclass
class ViewServer:
    """A server of one report folder, bound but not yet serving: `serve_forever()` (in any thread), then
    `close()`."""

    server: ThreadingHTTPServer
    renderer: BinRenderer

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/index.html"

    def serve_forever(self) -> None:
        self.server.serve_forever()

    def close(self) -> None:
        """Release the port and the shard readers, once `serve_forever` has returned (after Ctrl-C, or
        `server.shutdown()` from another thread)."""
        self.server.server_close()
        self.renderer.close()


def start_server(out: Path, root: Path, opts: ViewOptions, port: int = 0) -> ViewServer:
    """A server of `out` bound to 127.0.0.1:`port` (0: a free port), rendering `root`'s bins on request."""
    manifest = Manifest.from_dict(
        json.loads((root / "manifest.json").read_text()), shard_format=opts.shard_format
    )
    renderer = BinRenderer(root, manifest, out, opts)
    handler = type("ViewHandler", (_Handler,), {"renderer": renderer, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(out)))
    return ViewServer(server, renderer)


def serve(out: Path, root: Path, opts: ViewOptions, port: int = 0) -> int:
    """Serve `out` until interrupted; prints the URL."""
    view = start_server(out, root, opts, port)
    print(f"mmpack view: serving {view.url} (Ctrl-C to stop)", flush=True)
    try:
        view.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        view.close()
    return 0
