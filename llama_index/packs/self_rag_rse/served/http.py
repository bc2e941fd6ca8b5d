"""A small JSON-over-HTTP client for model servers: explicit timeouts, bounded concurrency, and
errors that name the URL and say what to do.

One ``httpx.AsyncClient`` and one semaphore per event loop (an async client belongs to the loop
that created it; the package's sync bridge runs everything on one private loop, so in practice
there is one of each). At most ``num_workers`` requests are in flight per loop: set it to the
server's parallel slots (llama.cpp ``--parallel``) or a little more. Nothing is retried: a model
server that failed once is reported, not hammered. ``timeout`` bounds each request from sending to
the last byte of the answer (httpx's own timeouts bound each read only: a server that drips a
byte a second would never trip them). Redirects are not followed: one is reported with its
target, so the URL can be fixed once instead of paying a detour on every request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import urljoin

import httpx

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.served.wire import MalformedBody

T = TypeVar("T")

logger = logging.getLogger(__name__)


class ServerError(RuntimeError):
    """A model server could not be used; the message names the URL and the fix."""

    def __init__(self, message: str, url: str) -> None:
        super().__init__(message)
        self.url = url


class ServerUnavailable(ServerError):
    """Nothing answered at the URL (connection refused, unknown host)."""


class ServerTimeout(ServerError):
    """The server did not answer within the timeout."""


class ServerHTTPError(ServerError):
    """The server answered with an HTTP error status."""

    def __init__(self, message: str, url: str, status: int, body: str) -> None:
        super().__init__(message, url)
        self.status = status
        self.body = body


class ServerNotReady(ServerHTTPError):
    """HTTP 429, 502, 503 or 504: the server (or a proxy before it) cannot answer yet: retry."""


class ServerRedirect(ServerError):
    """The server answered with a redirect (HTTP 3xx), which the client does not follow."""

    def __init__(self, message: str, url: str, status: int, location: str | None) -> None:
        super().__init__(message, url)
        self.status = status
        self.location = location


class MalformedResponse(ServerError):
    """The server answered 200 with a body that is not what the API promises."""


async def _timed(step: Awaitable[T], left: float) -> tuple[T, float]:
    """``step``'s result and the seconds left of ``left`` after it (timing out past them)."""
    began = time.monotonic()
    return await asyncio.wait_for(step, max(left, 0.0)), left - (time.monotonic() - began)


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class JSONClient:
    """POST/GET JSON to one server.

    Args:
        base_url: the server's root (``http://127.0.0.1:8080``); paths are appended to it.
        timeout: seconds one request may take in all (connecting, waiting for the model,
            reading); connecting alone gets at most 10 s.
        num_workers: most requests in flight at once (per event loop).
        api_key: sent as ``Authorization: Bearer <key>`` when given.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        num_workers: int = 8,
        api_key: str | None = None,
    ) -> None:
        require_counts("JSONClient", num_workers=num_workers)
        # None (no limit) would let a stalled server hang the query for ever; True is no number.
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not (number and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clients: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[httpx.AsyncClient, asyncio.Semaphore]
        ] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        #: Requests sent so far (for benchmarks and traces).
        self.requests = 0

    def url(self, path: str) -> str:
        """The full URL of ``path``."""
        return f"{self.base_url}/{path.lstrip('/')}"

    def _client(self) -> tuple[httpx.AsyncClient, asyncio.Semaphore]:
        loop = asyncio.get_running_loop()
        with self._lock:
            # A client holds its loop, so a weak key alone never lets go: drop closed loops'
            # clients, or every asyncio.run(aquery(...)) would keep its sockets open.
            for closed in [old for old in self._clients if old.is_closed()]:
                del self._clients[closed]
            pair = self._clients.get(loop)
            if pair is None or pair[0].is_closed:
                client = httpx.AsyncClient(
                    timeout=httpx.Timeout(self.timeout, connect=min(10.0, self.timeout)),
                    headers=self._headers,
                    limits=httpx.Limits(max_connections=self.num_workers),
                )
                pair = self._clients[loop] = (client, asyncio.Semaphore(self.num_workers))
            return pair

    async def post(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST ``body`` as JSON and return the decoded JSON answer."""
        return await self._request("POST", path, body)

    async def get(self, path: str) -> Any:
        """GET ``path`` and return the decoded JSON answer."""
        return await self._request("GET", path, None)

    async def post_parsed(self, path: str, body: Mapping[str, Any], parse: Callable[[Any], T]) -> T:
        """POST ``body`` to ``path`` and ``parse`` the answer; a body ``parse`` rejects
        (:class:`~.wire.MalformedBody`) becomes :class:`MalformedResponse` naming the URL.
        """
        answer = await self.post(path, body)
        try:
            return parse(answer)
        except MalformedBody as exc:
            url = self.url(path)
            raise MalformedResponse(f"{url} answered an unexpected body: {exc}", url) from exc

    async def _request(self, method: str, path: str, body: Mapping[str, Any] | None) -> Any:
        url = self.url(path)
        client, limit = self._client()
        async with limit:  # waiting for a free worker is not part of the request's time
            self.requests += 1
            try:
                response = await asyncio.wait_for(
                    client.request(method, url, json=body), self.timeout
                )
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise self._failure(method, url, exc) from exc
        self._check_status(method, path, response, response.text)
        try:
            return response.json()
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise MalformedResponse(
                f"{method} {url} answered HTTP {response.status_code} with a body that is not "
                f"JSON (or nests too deep): {_clip(response.text)!r}",
                url,
            ) from exc

    async def stream_parsed(
        self, path: str, body: Mapping[str, Any], parse: Callable[[Any], T],
        finished: Callable[[T], bool],
    ) -> AsyncIterator[T]:  # fmt: skip
        """POST ``body`` to ``path`` and yield each server-sent event's JSON, ``parse``d, as it
        arrives. The stream ends at ``data: [DONE]`` or with the body; a body that ends before
        ``[DONE]`` and before an event that ``finished`` says ends the answer was cut (a proxy
        or the server closed the connection): :class:`MalformedResponse` naming the URL.
        ``timeout`` bounds the time spent waiting for the server in all, not the time the
        caller spends between events. A task of its own reads the stream, so a caller that stops
        reading but keeps the iterator (a chat UI's stopped answer) holds no worker once the
        server has answered; closing the iterator stops the reading.
        """
        queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        reader = asyncio.ensure_future(self._read(queue, path, body, parse, finished))
        reader.add_done_callback(
            lambda done: queue.put_nowait((True, done.cancelled() or done.exception()))
        )
        try:
            while not (item := await queue.get())[0]:
                yield item[1]
            if isinstance(item[1], BaseException):
                raise item[1]
        finally:
            reader.cancel()

    async def _read(
        self, queue: asyncio.Queue[tuple[bool, Any]], path: str, body: Mapping[str, Any],
        parse: Callable[[Any], T], finished: Callable[[T], bool],
    ) -> None:  # fmt: skip
        url = self.url(path)
        client, limit = self._client()
        left = self.timeout
        async with limit:
            self.requests += 1
            request = client.build_request("POST", url, json=body)
            try:
                response, left = await _timed(client.send(request, stream=True), left)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise self._failure("POST", url, exc) from exc
            try:
                if response.status_code >= 300:
                    text, left = await _timed(response.aread(), left)
                    self._check_status("POST", path, response, text.decode("utf-8", "replace"))
                lines = response.aiter_lines()
                data: list[str] = []  # the data lines of the event being read
                events, done = 0, False
                while True:
                    line: str | None
                    try:
                        line, left = await _timed(anext(lines), left)
                    except StopAsyncIteration:
                        line = None
                    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                        raise self._failure("POST", url, exc) from exc
                    if line:  # a blank line (or the body's end) ends an event
                        if line.startswith("data:"):
                            # SSE: an event's data may span several lines, joined by newlines.
                            data.append(line[5:].removeprefix(" "))
                        continue  # comments, event names and ids are not used
                    if data:
                        joined, data = "\n".join(data).strip(), []
                        if joined == "[DONE]":
                            return
                        event = self._event(url, joined, parse)
                        events += 1
                        done = done or finished(event)
                        queue.put_nowait((False, event))
                    if line is None:
                        break
                if not done:
                    kind = response.headers.get("content-type", "")
                    cause = "the connection was cut, by the server or a proxy before it"
                    if not events and "event-stream" not in kind:
                        cause = f"it answered {kind!r}, not an event stream: it does not stream"
                    raise MalformedResponse(
                        f"POST {url} ended its stream after {events} event(s), without [DONE] or "
                        f"an event that ends the answer: {cause}; the answer is incomplete",
                        url,
                    )
            finally:
                await response.aclose()

    def _event(self, url: str, data: str, parse: Callable[[Any], T]) -> T:
        try:
            event = json.loads(data)
        except (json.JSONDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise MalformedResponse(
                f"POST {url} streamed an event that is not JSON: {_clip(data)!r}", url
            ) from exc
        if isinstance(event, Mapping) and "error" in event and len(event) <= 2:
            raise ServerHTTPError(
                f"POST {url} streamed an error: {_clip(json.dumps(event['error']))}", url, 200, data
            )
        try:
            return parse(event)
        except MalformedBody as exc:
            raise MalformedResponse(f"{url} streamed an unexpected event: {exc}", url) from exc

    def _failure(self, method: str, url: str, exc: BaseException) -> ServerError:
        """The error to raise for a request that failed before an answer came."""
        if isinstance(exc, httpx.TimeoutException | asyncio.TimeoutError):
            return ServerTimeout(
                f"{method} {url} timed out after {self.timeout:g} s ({type(exc).__name__}): "
                "raise timeout=, lower max_new_tokens, or give the server more parallel slots",
                url,
            )
        if isinstance(exc, httpx.ConnectError):
            return ServerUnavailable(
                f"cannot connect to {url} ({exc}): is the model server running and is the "
                "URL right (e.g. http://127.0.0.1:8080, with /v1 for OpenAI-style servers)?",
                url,
            )
        return ServerUnavailable(f"{method} {url} failed: {type(exc).__name__}: {exc}", url)

    def _check_status(self, method: str, path: str, response: httpx.Response, text: str) -> None:
        """Raise for a redirect or an HTTP error status."""
        url = self.url(path)
        if 300 <= response.status_code < 400:
            raise self._redirect(method, path, response)
        if (status := response.status_code) >= 400:
            error, wait = ServerHTTPError, ""
            if status in (429, 502, 503, 504):
                error, wait = ServerNotReady, " (not ready: loading, restarting or overloaded)"
            message = f"{method} {url} answered HTTP {status}{wait}: {_clip(text)}"
            raise error(message, url, status, text)

    def _redirect(self, method: str, path: str, response: httpx.Response) -> ServerRedirect:
        url, status = self.url(path), response.status_code
        if not (header := response.headers.get("location")):
            why = f"{method} {url} answered HTTP {status} (a redirect) with no Location: point "
            why += "base_url at the server's final URL (redirects are not followed)"
            return ServerRedirect(why, url, status, None)
        location = urljoin(url, header)
        # The base URL that reaches the same path directly, when the target keeps the path.
        target = location.split("?", 1)[0].split("#", 1)[0]
        suffix = "/" + path.lstrip("/")
        base = target[: -len(suffix)] if target.endswith(suffix) else target
        why = f"{method} {url} answered HTTP {status}, a redirect to {location}: redirects are not "
        why += f"followed; point base_url at {base} (the final URL) instead"
        return ServerRedirect(why, url, status, location)

    def close(self) -> None:
        """Close the connections of every loop (a later request opens new ones)."""
        with self._lock:
            pairs = list(self._clients.items())
            self._clients.clear()
        for loop, (client, _) in pairs:
            if client.is_closed or loop.is_closed():
                continue  # a closed loop took its transports with it
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            try:
                if running is loop:
                    loop.create_task(client.aclose())
                elif loop.is_running():
                    asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=5)
                else:
                    loop.run_until_complete(client.aclose())
            except Exception as exc:  # closing must not raise over a finished query
                logger.debug("closing the HTTP client failed: %r", exc)
