"""A tiny HTTP server on loopback for tests: canned answers, or a proxy with faults.

``StubServer(handler)`` runs ``handler(method, path, body) -> Reply`` for every request in a
thread of its own (``ThreadingHTTPServer``), records how many requests it saw and how many were
in flight at once, and stops in ``close()`` (or at the end of a ``with`` block).
``DripServer(answer, interval)`` sends a whole HTTP answer one byte every ``interval`` seconds:
a server that never stalls long enough for a per-read timeout. ``EndlessServer(head, piece)``
sends ``head`` and then ``piece`` over and over: a body that never ends.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Reply:
    """What the stub answers: status, raw body, and a delay before answering; with ``pace``,
    the body goes one line at a time, ``pace`` seconds apart (a server streaming slowly).
    """

    status: int = 200
    body: bytes = b"{}"
    delay: float = 0.0
    headers: dict[str, str] = field(default_factory=dict)
    pace: float = 0.0

    @classmethod
    def json(cls, value: Any, status: int = 200, delay: float = 0.0) -> Reply:
        return cls(status, json.dumps(value).encode(), delay)


Handler = Callable[[str, str, Any], Reply]


class StubServer:
    """An HTTP server on 127.0.0.1 with a free port; ``url`` is its root."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.requests: list[tuple[str, str]] = []
        self.headers: dict[str, str] = {}
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        stub = self

        class _Handler(BaseHTTPRequestHandler):
            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                with stub._lock:
                    stub.requests.append((method, self.path))
                    stub.headers = dict(self.headers)  # the last request's
                    stub.in_flight += 1
                    stub.max_in_flight = max(stub.max_in_flight, stub.in_flight)
                try:
                    reply = stub.handler(method, self.path, body)
                    if reply.delay:
                        time.sleep(reply.delay)
                finally:
                    # Done before answering: once answered, the client may send its next
                    # request, which must not count as overlapping with this one.
                    with stub._lock:
                        stub.in_flight -= 1
                try:
                    self.send_response(reply.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(reply.body)))
                    for name, value in reply.headers.items():
                        self.send_header(name, value)
                    self.end_headers()
                    for line in (
                        reply.body.splitlines(keepends=True) if reply.pace else [reply.body]
                    ):
                        self.wfile.write(line)
                        self.wfile.flush()
                        time.sleep(reply.pace)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (a timeout test)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def count(self, path: str) -> int:
        return sum(1 for _, p in self.requests if p == path)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> StubServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def forward(upstream: str, method: str, path: str, body: Any, timeout: float = 30.0) -> Reply:
    """Pass a request on to ``upstream`` and return its answer."""
    import httpx

    response = httpx.request(method, upstream + path, json=body, timeout=timeout)
    return Reply(response.status_code, response.content)


class DripServer:
    """A raw HTTP server on 127.0.0.1 that answers every connection with ``answer`` (status line,
    headers and body), one byte every ``interval`` seconds after the first ``at_once`` bytes; it
    stops dripping when the client goes away or at ``close()``. ``sent`` counts the bytes sent
    so far (a client that gave up early left the rest unsent).
    """

    def __init__(self, answer: bytes, interval: float, at_once: int = 0) -> None:
        self.answer = answer
        self.interval = interval
        self.at_once = at_once
        self.sent = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self._sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)  # the request; its content does not matter
                conn.sendall(self.answer[: self.at_once])
                self.sent += self.at_once
                for i in range(self.at_once, len(self.answer)):
                    if self._stop.wait(self.interval):
                        return
                    conn.sendall(self.answer[i : i + 1])
                    self.sent += 1
            except OSError:
                return  # the client gave up

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> DripServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class EndlessServer:
    """A raw HTTP server on 127.0.0.1 that answers every connection with ``head`` (status line
    and headers) and then ``piece`` over and over, until the client goes away or ``close()``;
    ``sent`` counts the bytes sent.
    """

    def __init__(self, head: bytes, piece: bytes) -> None:
        self.head = head
        self.piece = piece
        self.sent = 0
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen()
        self._sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._flood, args=(conn,), daemon=True).start()

    def _flood(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(5)
            try:
                conn.recv(65536)  # the request; its content does not matter
                conn.sendall(self.head)
                while not self._stop.is_set():
                    conn.sendall(self.piece)
                    self.sent += len(self.piece)
            except OSError:
                return  # the client gave up

    def close(self) -> None:
        self._stop.set()
        self._sock.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> EndlessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
