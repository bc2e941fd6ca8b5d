"""A small JSON-over-HTTP client for model servers: explicit timeouts, bounded concurrency,
answers bounded in size, and errors (:mod:`.errors`) that name the URL and say what to do.

One ``httpx.AsyncClient`` and one semaphore per event loop (an async client belongs to the loop
that created it; the package's sync bridge runs everything on one private loop, so in practice
there is one of each). At most ``num_workers`` requests are in flight per loop: set it to the
server's parallel slots (llama.cpp ``--parallel``) or a little more. Nothing is retried: a model
server that failed once is reported, not hammered. ``timeout`` bounds each request from sending to
the last byte of the answer, decoded and parsed (httpx's own timeouts bound each read only: a
server that drips a byte a second would never trip them). ``max_response_bytes`` bounds the answer,
as sent and as decoded (the client decodes gzip and deflate itself, so a compressed bomb stops at
the limit): a body or a stream that never ends is refused at it. Redirects are not followed: one
is reported with its target, so the URL can be fixed once instead of paying a detour on every
request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import weakref
import zlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, TypeVar
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import httpx

from llama_index.packs.self_rag_rse.common.options import require_counts
from llama_index.packs.self_rag_rse.common.tracing import Completed, ModelCalls
from llama_index.packs.self_rag_rse.served.errors import (
    MalformedResponse,
    ServerError,
    ServerHTTPError,
    ServerNotReady,
    ServerRedirect,
    ServerTimeout,
    ServerUnavailable,
)
from llama_index.packs.self_rag_rse.served.wire import MalformedBody, completion_counts

T = TypeVar("T")

#: The most bytes one answer (a body, or a whole stream) may hold, as sent and as decoded: 16 MiB.
#: The largest real answer, a 50-token completion with 20 log-probs per position, is ~88 KB on
#: llama-server; a follow-up for a whole 32,000-token vocabulary at one position ~2.3 MB.
MAX_RESPONSE_BYTES = 16 << 20
#: Content encodings the client asks for and decodes itself, within the limit (zlib reads a gzip
#: or a zlib header alike with window bits 32 + 15); a body in any other fails to decode. httpx
#: would also take brotli and zstd, and decode each read whole: one 64 KB read of zstd may hold
#: gigabytes.
_ENCODINGS = ("gzip", "deflate")
_GZIP_OR_ZLIB = 32 + zlib.MAX_WBITS

logger = logging.getLogger(__name__)


async def _timed(step: Awaitable[T], left: float) -> tuple[T, float]:
    """``step``'s result and the seconds left of ``left`` after it (timing out past them)."""
    began = time.monotonic()
    return await asyncio.wait_for(step, max(left, 0.0)), left - (time.monotonic() - began)


def _clip(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


async def _lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of a stream's body, as text (ended by LF or CRLF, as model servers send
    server-sent events); a line is read once its end has arrived.
    """
    rest = bytearray()  # the line that has not ended yet
    async for chunk in chunks:
        rest += chunk
        if b"\n" not in chunk:
            continue  # the line goes on: nothing to split
        *lines, rest = rest.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode("utf-8", "replace")
    # A last line that never ended is dropped, as server-sent events drop an unfinished event.


class JSONClient:
    """POST/GET JSON to one server.

    Args:
        base_url: the server's root (``http://127.0.0.1:8080``); paths are appended to it. A
            user and password in it (``http://user:pw@host``) are sent as basic authentication
            and masked wherever the URL is written.
        timeout: seconds one request may take in all (connecting, waiting for the model,
            reading and decoding every byte, parsing); connecting alone gets at most 10 s.
        num_workers: most requests in flight at once (per event loop).
        api_key: sent as ``Authorization: Bearer <key>`` when given.
        max_response_bytes: the most bytes one answer (a body, or a whole stream) may hold, as
            sent and as decoded (:data:`MAX_RESPONSE_BYTES`); past them the reading stops with
            :class:`MalformedResponse` naming the URL and the limit.
    """

    def __init__(
        self,
        base_url: str,
        *,
        timeout: float = 120.0,
        num_workers: int = 8,
        api_key: str | None = None,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        require_counts("JSONClient", num_workers=num_workers, max_response_bytes=max_response_bytes)
        if max_response_bytes is None:  # a body without a limit may take all the memory there is
            raise ValueError("JSONClient: max_response_bytes must be an integer >= 1, got None")
        # None (no limit) would let a stalled server hang the query for ever; True is no number.
        number = isinstance(timeout, int | float) and not isinstance(timeout, bool)
        if not (number and timeout > 0 and math.isfinite(timeout)):
            raise ValueError(f"timeout must be a finite number of seconds > 0, got {timeout!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = float(timeout)
        self.num_workers = num_workers
        self.max_response_bytes = max_response_bytes
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A user and password in the URL go as basic authentication, so that no URL requested
        # (httpx logs each one) holds them.
        parts = urlsplit(self.base_url)
        self._auth = (
            httpx.BasicAuth(unquote(parts.username or ""), unquote(parts.password or ""))
            if "@" in parts.netloc
            else None
        )
        self._root = urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
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
                    base_url=self._root,
                    auth=self._auth,
                    timeout=httpx.Timeout(self.timeout, connect=min(10.0, self.timeout)),
                    headers={"Accept-Encoding": ", ".join(_ENCODINGS), **self._headers},
                    limits=httpx.Limits(max_connections=self.num_workers),
                )
                pair = self._clients[loop] = (client, asyncio.Semaphore(self.num_workers))
            return pair

    async def post(self, path: str, body: Mapping[str, Any]) -> Any:
        """POST ``body`` as JSON and return the decoded JSON answer.

        A completion (a body with a ``prompt``) is a model call in LlamaIndex instrumentation
        (:class:`~llama_index.packs.self_rag_rse.common.tracing.ModelCalls`): its prompt, its
        text and the token counts the server reported (:func:`~.wire.completion_counts`).
        """
        if "prompt" not in body:
            return await self._request("POST", path, body)
        with self._model_call(body) as calls:
            answer = await self._request("POST", path, body)
            calls.end(lambda: [Completed(*completion_counts(answer))])
        return answer

    def _model_call(self, body: Mapping[str, Any]) -> ModelCalls:
        """The completion request ``body`` as a model call in traces (its prompt as sent)."""
        prompt = body.get("prompt", "")
        return ModelCalls(
            "JSONClient.complete",
            str(body.get("model") or self._root),
            prompts=lambda: [prompt if isinstance(prompt, str) else json.dumps(prompt)],
        )

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
                return await asyncio.wait_for(
                    self._answer(client, method=method, path=path, body=body), self.timeout
                )
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise self._failure(method, url, exc, client) from exc

    async def _answer(
        self, client: httpx.AsyncClient, *, method: str, path: str, body: Mapping[str, Any] | None
    ) -> Any:
        """Send the request; read, decode and parse its answer (all within the caller's timeout:
        the size limit keeps decoding and parsing short).
        """
        url = self.url(path)
        request = client.build_request(method, path.lstrip("/"), json=body)
        response = await client.send(request, stream=True)
        try:
            content = await self._content(response, method, url)
        finally:
            await response.aclose()
        text = content.decode("utf-8", "replace")
        self._check_status(method, path, response, text)
        try:
            return json.loads(content)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise MalformedResponse(
                f"{method} {url} answered HTTP {response.status_code} with a body that is not "
                f"JSON (or nests too deep): {_clip(text)!r}",
                url,
            ) from exc

    async def _body(self, response: httpx.Response, method: str, url: str) -> AsyncIterator[bytes]:
        """The body's bytes, decoded, as they arrive. More than ``max_response_bytes`` of them,
        as sent or as decoded, is :class:`MalformedResponse`: a body that never ends stops at
        the limit, and a gzip bomb is never decoded past it.
        """
        encoding = (response.headers.get("content-encoding") or "identity").strip().lower()
        decoder = None if encoding == "identity" else zlib.decompressobj(_GZIP_OR_ZLIB)
        received = 0
        decoded = 0
        async for chunk in response.aiter_raw():
            received += len(chunk)
            if decoder is not None:
                try:
                    # One byte past the limit at most: enough to tell that it was passed.
                    chunk = decoder.decompress(chunk, self.max_response_bytes - decoded + 1)
                except zlib.error as exc:
                    raise MalformedResponse(
                        f"{method} {url} answered a body encoded {encoding!r} that does not "
                        f"decode as {' or '.join(_ENCODINGS)}, which the client asks for "
                        f"({exc}): the server, or a proxy before it, ignores Accept-Encoding "
                        "(turn its compression off, or limit it to gzip) or sends a broken body",
                        url,
                    ) from exc
            decoded += len(chunk)
            if max(received, decoded) > self.max_response_bytes:
                raise MalformedResponse(
                    f"{method} {url} answered more than max_response_bytes="
                    f"{self.max_response_bytes:,} bytes (as sent or decoded; {received:,} "
                    "received): far more than a completion with log-probs takes, so the server, "
                    "or a proxy before it, does not answer as a model server does; if its "
                    "answers really are that large, raise max_response_bytes",
                    url,
                )
            yield chunk

    async def _content(self, response: httpx.Response, method: str, url: str) -> bytes:
        """The whole body, decoded, within the size limit (see :meth:`_body`)."""
        return b"".join([chunk async for chunk in self._body(response, method, url)])

    async def stream_parsed(
        self,
        path: str,
        body: Mapping[str, Any],
        parse: Callable[[Any], T],
        finished: Callable[[T], bool],
    ) -> AsyncGenerator[T, None]:
        """POST ``body`` to ``path`` and yield each server-sent event's JSON, ``parse``d, as it
        arrives. The stream ends at ``data: [DONE]`` or with the body; a body that ends before
        ``[DONE]`` and before an event that ``finished`` says ends the answer was cut (a proxy
        or the server closed the connection): :class:`MalformedResponse` naming the URL.
        ``timeout`` bounds the time spent waiting for the server in all, not the time the
        caller spends between events. A task of its own reads the stream, so a caller that stops
        reading but keeps the iterator (a chat UI's stopped answer) holds no worker once the
        server has answered; closing the iterator stops the reading. The request is a model call
        in traces, as :meth:`post`'s, ending with the stream (or with what a caller read).
        """
        # (False, event) for each event, then (True, the error that ended the reading, if any).
        queue: asyncio.Queue[tuple[bool, Any]] = asyncio.Queue()
        # The stream as one model call: its text so far, the counts its last event reported.
        streamed = [Completed("", 0, 0)]

        def counted(event: Any) -> T:
            text, prompt_tokens, completion_tokens = completion_counts(event)
            streamed[0] = Completed(streamed[0].text + text, prompt_tokens, completion_tokens)
            return parse(event)

        with self._model_call(body) as calls:
            reader = asyncio.ensure_future(
                self._read(queue=queue, path=path, body=body, parse=counted, finished=finished)
            )
            reader.add_done_callback(
                lambda done: queue.put_nowait((True, done.cancelled() or done.exception()))
            )
            try:
                while True:
                    ended, item = await queue.get()
                    if ended:
                        break
                    yield item
                if isinstance(item, BaseException):
                    raise item
            except GeneratorExit:
                pass  # the caller stopped reading: the call ends with what it read
            finally:
                reader.cancel()
            calls.end(lambda: streamed)

    async def _read(
        self,
        *,
        queue: asyncio.Queue[tuple[bool, Any]],
        path: str,
        body: Mapping[str, Any],
        parse: Callable[[Any], T],
        finished: Callable[[T], bool],
    ) -> None:
        url = self.url(path)
        client, limit = self._client()
        left = self.timeout
        async with limit:
            self.requests += 1
            request = client.build_request("POST", path.lstrip("/"), json=body)
            try:
                response, left = await _timed(client.send(request, stream=True), left)
            except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                raise self._failure("POST", url, exc, client) from exc
            try:
                if response.status_code >= 300:
                    text, left = await _timed(self._content(response, "POST", url), left)
                    self._check_status("POST", path, response, text.decode("utf-8", "replace"))
                lines = _lines(self._body(response, "POST", url))
                data: list[str] = []  # the data lines of the event being read
                events = 0
                done = False
                while True:
                    line: str | None
                    try:
                        line, left = await _timed(anext(lines), left)
                    except StopAsyncIteration:
                        line = None
                    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
                        raise self._failure("POST", url, exc, client) from exc
                    if line:  # a blank line (or the body's end) ends an event
                        if line.startswith("data:"):
                            # SSE: an event's data may span several lines, joined by newlines.
                            data.append(line[5:].removeprefix(" "))
                        continue  # comments, event names and ids are not used
                    if data:
                        joined = "\n".join(data).strip()
                        data = []
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
        # An error object in place of an event (llama-server's, OpenAI's: "error" and a code).
        if isinstance(event, Mapping) and "error" in event and len(event) <= 2:
            raise ServerHTTPError(
                f"POST {url} streamed an error: {_clip(json.dumps(event['error']))}",
                url=url,
                status=200,
                body=data,
            )
        try:
            return parse(event)
        except MalformedBody as exc:
            raise MalformedResponse(f"{url} streamed an unexpected event: {exc}", url) from exc

    def _failure(
        self, method: str, url: str, exc: BaseException, client: httpx.AsyncClient
    ) -> ServerError:
        """The error to raise for a request on ``client`` that failed before its answer was read."""
        if client.is_closed:  # close() from another thread cut the connection under the request
            return ServerError(
                f"{method} {url} was stopped: the client was closed (close(), e.g. the critic's) "
                f"while the request was in flight ({type(exc).__name__}); close a critic once its "
                "queries are done, or run the query again (a new request opens new connections)",
                url,
            )
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
        status = response.status_code
        if 300 <= status < 400:
            raise self._redirect(method, path, response)
        if status in (429, 502, 503, 504):  # see ServerNotReady
            raise ServerNotReady(
                f"{method} {url} answered HTTP {status} (not ready: loading, restarting or "
                f"overloaded): {_clip(text)}; try again once the server is ready",
                url=url,
                status=status,
                body=text,
            )
        if status >= 400:
            raise ServerHTTPError(
                f"{method} {url} answered HTTP {status}: {_clip(text)}",
                url=url,
                status=status,
                body=text,
            )

    def _redirect(self, method: str, path: str, response: httpx.Response) -> ServerRedirect:
        url = self.url(path)
        status = response.status_code
        if not (header := response.headers.get("location")):
            return ServerRedirect(
                f"{method} {url} answered HTTP {status} (a redirect) with no Location: point "
                "base_url at the server's final URL (redirects are not followed)",
                url=url,
                status=status,
                location=None,
            )
        location = urljoin(url, header)
        # The base URL that reaches the same path directly, when the target keeps the path.
        target = location.split("?", 1)[0].split("#", 1)[0]
        suffix = "/" + path.lstrip("/")
        base = target[: -len(suffix)] if target.endswith(suffix) else target
        return ServerRedirect(
            f"{method} {url} answered HTTP {status}, a redirect to {location}: redirects are not "
            f"followed; point base_url at {base} (the final URL) instead",
            url=url,
            status=status,
            location=location,
        )

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
