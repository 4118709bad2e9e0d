"""Real storage servers on 127.0.0.1 for loader tests and benchmarks (no pytest dependency).

- `moto_s3(...)`: moto's ThreadedMotoServer (an S3 endpoint) plus s3fs storage options to reach it.
- `http_server(directory)`: a plain threaded `http.server` serving a folder.
- `FaultProxy(upstream)`: an HTTP proxy that injects faults into GETs of paths containing `fault_path_part`:
  503 responses, connection resets, truncated bodies, slow bodies and corrupted bytes. Faults are bounded:
  each path gets at most `max_faults_per_path` of them, so a client with enough retries always succeeds.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

FAULT_KINDS = ("503", "reset", "truncate", "slow", "corrupt")


def _serve_in_thread(server: http.server.ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    return thread


class _QuietFileHandler(http.server.SimpleHTTPRequestHandler):
    def __init__(self, *args: Any, requests: list[str] | None = None, **kwargs: Any) -> None:
        self._requests = requests
        super().__init__(*args, **kwargs)

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def send_head(self) -> Any:
        if self._requests is not None:
            self._requests.append(self.translate_path(self.path))  # the file the server resolves it to
        return super().send_head()


@contextlib.contextmanager
def http_server(directory: str | Path, requests: list[str] | None = None) -> Iterator[str]:
    """Serves `directory` over HTTP on 127.0.0.1; yields the base URL (no trailing slash). `requests`, when
    given, receives the local path each GET or HEAD resolved to (what the server decoded and normalised)."""
    handler = partial(_QuietFileHandler, directory=str(directory), requests=requests)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = _serve_in_thread(server)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@dataclass
class S3Endpoint:
    """A running moto S3 server: its URL and the s3fs storage options that reach it."""

    endpoint_url: str
    storage_options: dict[str, Any]

    def filesystem(self) -> Any:
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)

    def make_bucket(self, bucket: str) -> Any:
        """Creates `bucket` if needed; returns a fresh s3fs filesystem of the server."""
        fs = self.filesystem()
        if not fs.exists(bucket):
            # boto3, not fs.mkdir: s3fs sends LocationConstraint=us-east-1, which S3 (and moto) reject
            import boto3

            boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name="us-east-1",
                aws_access_key_id=self.storage_options["key"],
                aws_secret_access_key=self.storage_options["secret"],
            ).create_bucket(Bucket=bucket)
            fs.invalidate_cache()
        return fs

    def upload_folder(self, local: str | Path, bucket: str, prefix: str) -> str:
        """Creates `bucket` if needed, copies the folder there; returns the s3:// URL of the copy."""
        fs = self.make_bucket(bucket)
        local = Path(local)
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            fs.put_file(str(path), f"{bucket}/{prefix}/{path.relative_to(local).as_posix()}")
        return f"s3://{bucket}/{prefix}"


@contextlib.contextmanager
def link_proxy_process(upstream: str, link_bytes_per_s: float) -> Iterator[str]:
    """A `FaultProxy` with no faults and a link of `link_bytes_per_s`, in its own process (so its work never
    competes with the measured reader for a GIL); yields its URL."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    recv_end, send_end = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    proc = ctx.Process(target=_run_link_proxy, args=(upstream, link_bytes_per_s, send_end, stop), daemon=True)
    proc.start()
    try:
        if not recv_end.poll(30):
            raise RuntimeError("the link proxy did not start")
        yield recv_end.recv()
    finally:
        stop.set()
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()


def _run_link_proxy(upstream: str, link_bytes_per_s: float, conn: Any, stop: Any) -> None:
    with FaultProxy(upstream, FaultPlan(kinds=()), link_bytes_per_s=link_bytes_per_s) as proxy:
        conn.send(proxy.url)
        stop.wait()


def s3_storage_options(endpoint_url: str) -> dict[str, Any]:
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint_url},
        "config_kwargs": {"retries": {"max_attempts": 1}},  # let the loader's own retries do the work
    }


@contextlib.contextmanager
def moto_s3(*, own_process: bool = False) -> Iterator[S3Endpoint]:
    """Starts moto's S3 server on a free port of 127.0.0.1.

    By default the server runs in a thread of this process (cheap, for tests). Benchmarks pass
    `own_process=True`: a server thread would compete with the measured reader for this process's GIL,
    which a real object store never does.
    """
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    if own_process:
        with _moto_server_process() as endpoint:
            yield S3Endpoint(endpoint, s3_storage_options(endpoint))
        return
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    try:
        yield S3Endpoint(endpoint, s3_storage_options(endpoint))
    finally:
        server.stop()


@contextlib.contextmanager
def _moto_server_process(start_timeout_s: float = 30.0) -> Iterator[str]:
    """`python -m moto.server` on a free port of 127.0.0.1; yields its URL once it answers."""
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto server on port {port} did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@dataclass
class FaultPlan:
    """Which faults to inject, in turn, on matching GETs; at most `max_faults_per_path` per path."""

    kinds: Sequence[str] = ("503", "reset", "truncate", "slow")
    max_faults_per_path: int = 2
    fault_path_part: str = "/shards/"
    slow_chunk_bytes: int = 64 << 10
    slow_delay_s: float = 0.002
    injected: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(FAULT_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; known: {FAULT_KINDS}")


class FaultProxy:
    """Forwards HTTP requests to `upstream` ("http://host:port"), injecting the faults of `plan`.

    `link_bytes_per_s` makes it a link of that bandwidth: response bodies of all connections together are
    paced to it (64 KiB at a time), as a node's share of an object store's bandwidth would be.
    """

    def __init__(
        self, upstream: str, plan: FaultPlan | None = None, link_bytes_per_s: float | None = None
    ) -> None:
        self.plan = plan or FaultPlan()
        self.link_bytes_per_s = link_bytes_per_s
        self._link_free_at = 0.0  # when the link has sent everything handed to it
        host, _, port = upstream.removeprefix("http://").partition(":")
        self._upstream = (host, int(port or 80))
        self._lock = threading.Lock()
        self._counter = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                proxy._forward(self)

            do_HEAD = do_PUT = do_POST = do_DELETE = do_GET

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = _serve_in_thread(self._server)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    @property
    def faults_injected(self) -> int:
        return sum(self.plan.injected.values())

    def _next_fault(self, method: str, path: str) -> str | None:
        plan = self.plan
        if method != "GET" or plan.fault_path_part not in path or not plan.kinds:
            return None
        with self._lock:
            done = plan.injected.get(path, 0)
            if done >= plan.max_faults_per_path:
                return None
            plan.injected[path] = done + 1
            kind = plan.kinds[self._counter % len(plan.kinds)]
            self._counter += 1
            return kind

    def _forward(self, h: http.server.BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        body = h.rfile.read(length) if length else None
        fault = self._next_fault(h.command, h.path)
        if fault == "503":
            h.close_connection = True
            payload = b"<Error><Code>SlowDown</Code><Message>injected</Message></Error>"
            h.send_response(503)
            h.send_header("Content-Length", str(len(payload)))
            h.send_header("Connection", "close")
            h.end_headers()
            h.wfile.write(payload)
            return
        if fault == "reset":
            h.close_connection = True
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        conn = http.client.HTTPConnection(*self._upstream, timeout=30)
        try:
            headers = {
                k: v for k, v in h.headers.items() if k.lower() not in ("connection", "proxy-connection")
            }
            conn.request(h.command, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read() if h.command != "HEAD" else b""
            status, resp_headers = resp.status, resp.getheaders()
        finally:
            conn.close()
        h.send_response(status)
        for key, value in resp_headers:
            if key.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                h.send_header(key, value)
        full_length = dict((k.lower(), v) for k, v in resp_headers).get("content-length", str(len(data)))
        h.send_header("Content-Length", full_length if h.command == "HEAD" else str(len(data)))
        if fault in ("truncate", "corrupt"):
            h.send_header("Connection", "close")
            h.close_connection = True
        h.end_headers()
        if h.command == "HEAD" or not data:
            return
        if fault == "truncate":
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        elif fault == "corrupt":
            mid = len(data) // 2
            h.wfile.write(data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1 :])
        elif fault == "slow":
            step = self.plan.slow_chunk_bytes
            for i in range(0, len(data), step):
                h.wfile.write(data[i : i + step])
                h.wfile.flush()
                time.sleep(self.plan.slow_delay_s)
        elif self.link_bytes_per_s:
            step = 64 << 10
            for i in range(0, len(data), step):
                chunk = data[i : i + step]
                with self._lock:  # take the next free slot of the shared link
                    start = max(time.monotonic(), self._link_free_at)
                    self._link_free_at = start + len(chunk) / self.link_bytes_per_s
                    done_at = self._link_free_at
                time.sleep(max(0.0, done_at - time.monotonic()))
                h.wfile.write(chunk)
        else:
            h.wfile.write(data)
