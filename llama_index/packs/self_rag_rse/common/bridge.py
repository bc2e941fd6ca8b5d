"""The one bridge between synchronous and asynchronous code in this package.

Three situations, one helper each:

* **Flows written once** (the Self-RAG query, the segment extraction) are generators that yield
  requests and receive results. :func:`drive` answers them with blocking calls, :func:`adrive`
  with awaited ones, so ``query``/``aquery`` and ``extract``/``aextract`` cannot drift apart.
* **Async-first work from sync code** (a critic's ``judge`` calling its ``ajudge``):
  :func:`run_sync` runs the coroutine on one private event loop in a daemon thread. One loop for
  the process, so async clients an LLM caches (bound to the loop that created them) keep working
  across calls, and it works the same whether or not the caller is inside a running loop.
* **Async streams from sync code** (a streamed answer read by ``query``): :func:`iterate_sync`
  awaits each item on the same private loop.
* **Blocking native work from async code** (llama.cpp decoding): :class:`SerialWorker` runs it
  on one dedicated thread per model, so decoding never competes with itself for the cores and
  calls reach the native library in order; a blocking retriever, :func:`run_blocking`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import functools
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def drive(flow: Generator[Any, Any, R], handle: Callable[[Any], Any]) -> R:
    """Run a request/response generator to completion, answering each request with ``handle``."""
    try:
        request = next(flow)
        while True:
            request = flow.send(handle(request))
    except StopIteration as done:
        return done.value


async def adrive(flow: Generator[Any, Any, R], handle: Callable[[Any], Awaitable[Any]]) -> R:
    """:func:`drive` with an async ``handle``."""
    try:
        request = next(flow)
        while True:
            request = flow.send(await handle(request))
    except StopIteration as done:
        return done.value


class _LoopThread:
    """A private event loop in a daemon thread."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        #: Streams being closed on the loop (:func:`iterate_sync`).
        self.closing: set[asyncio.Future[Any]] = set()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._ensure()
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError(
                "a synchronous method was called from inside its own async work: await the "
                "async variant (adecide_retrieval, ajudge, agenerate, aquery) instead"
            )
        # The task runs in a copy of the caller's context (its instrumentation span).
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            # The caller gave up (Ctrl-C): stop the work instead of leaving it to run on.
            future.cancel()
            raise

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="self-rag-rse-loop", daemon=True
                )
                thread.start()
                self._loop, self._thread = loop, thread
            return self._loop


_LOOP = _LoopThread()


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion from synchronous code and return its result.

    The coroutine runs on the package's private event loop; only the calling thread blocks, so
    this is safe inside a running event loop (e.g. a notebook) too.
    """
    return _LOOP.run(coro)


def iterate_sync(stream: AsyncIterator[T]) -> Iterator[T]:
    """Iterate an async iterator from synchronous code, item by item, on the private loop.

    Each item is awaited with :func:`run_sync` as the caller asks for it, so a token stream
    reaches a synchronous consumer as it is produced; stopping early closes the stream.
    """

    async def next_item() -> T:
        return await stream.__anext__()

    try:
        while True:
            try:
                yield run_sync(next_item())
            except StopAsyncIteration:
                return
    finally:
        # A stream left unread until the interpreter exits: the loop's thread is frozen by then.
        if (close := getattr(stream, "aclose", None)) is not None and not sys.is_finalizing():
            if threading.current_thread() is _LOOP._thread:
                # Collected on the loop's own thread, which cannot wait for itself: the close is
                # scheduled there, and held until done (a loop keeps weak references only).
                task = asyncio.ensure_future(close())
                task.add_done_callback(_LOOP.closing.discard)
                _LOOP.closing.add(task)
            else:
                run_sync(close())


async def run_blocking(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``func(*args, **kwargs)`` (a blocking retriever, postprocessor or store read) on a
    thread of its own, which ends with the call.

    Not the loop's default pool (the CPU count + 4 threads): a retriever that queries an engine
    synchronously (``RecursiveRetriever`` routing to one) waits there for a thread the
    retrievals around it hold, for ever. A thread per call, as core's engines run these in each
    caller's: no cap, and nothing left once a burst is over (a pool kept its peak thread count
    for the life of the process). A daemon thread: a call nobody waits for any more does not
    hold up the interpreter's exit.
    """
    call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    threading.Thread(
        target=_complete, args=(future, call), name="self-rag-rse-blocking", daemon=True
    ).start()
    return await asyncio.wrap_future(future)


def _complete(future: concurrent.futures.Future[T], call: Callable[[], T]) -> None:
    """Run ``call`` for ``future``, unless its caller gave up before it started."""
    if future.set_running_or_notify_cancel():
        try:
            future.set_result(call())
        except BaseException as error:  # as concurrent.futures does: the caller gets it
            future.set_exception(error)


class SerialWorker:
    """One thread that runs blocking calls in order, awaited from async code.

    llama.cpp decoding is blocking and uses its own thread pool: running it from many
    ``asyncio.to_thread`` workers oversubscribes the cores and interleaves calls on one native
    context. A worker per model keeps the calls in one thread and in order.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    async def run(self, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
        """Run ``func(*args, **kwargs)`` on the worker thread and await its result."""
        call = functools.partial(contextvars.copy_context().run, func, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._ensure(), call)

    def _ensure(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = concurrent.futures.ThreadPoolExecutor(1, self._name)
            return self._executor

    def close(self) -> None:
        """Wait for the running call, then stop the thread (a later ``run`` starts a new one)."""
        with self._lock:
            executor, self._executor = self._executor, None  # taken and cleared together
        if executor is not None:
            # From the worker thread itself (a call that closes its own critic) waiting would
            # deadlock: the running call is the one asking.
            executor.shutdown(wait=not threading.current_thread().name.startswith(self._name))
