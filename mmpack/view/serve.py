"""`mmpack view --serve`: the report folder over HTTP on 127.0.0.1 (stdlib `http.server`); a bin the folder does
not hold yet is rendered when the page asks for it."""

from __future__ import annotations

import functools
import json
import re
import threading
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


def serve(out: Path, root: Path, opts: ViewOptions, port: int = 0) -> int:
    """Serve `out` until interrupted; prints the URL."""
    manifest = Manifest.from_dict(
        json.loads((root / "manifest.json").read_text()), shard_format=opts.shard_format
    )
    renderer = BinRenderer(root, manifest, out, opts)
    handler = type("ViewHandler", (_Handler,), {"renderer": renderer, "lock": threading.Lock()})
    server = ThreadingHTTPServer(("127.0.0.1", port), functools.partial(handler, directory=str(out)))
    print(
        f"mmpack view: serving http://127.0.0.1:{server.server_address[1]}/index.html (Ctrl-C to stop)",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        renderer.close()
    return 0
