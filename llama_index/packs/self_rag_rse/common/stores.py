"""Async reads from vector stores that have only a synchronous client.

The README's embedded default, ``QdrantVectorStore(client=QdrantClient(path=...))``, has no async
client: every async method of the store raises "Async client is not initialized!" (LlamaIndex
issues #12474, #13391, #14151, #15621, #19548). A second, async client cannot help: Qdrant local
mode refuses to open one folder from two clients, and ``:memory:`` clients do not share data. So
where a store has no async client, our async paths run its synchronous call in a worker thread.
Local mode is not safe across threads either: every call on such a client, from a worker thread
or from synchronous code, holds that client's lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from llama_index.packs.self_rag_rse.common.bridge import run_blocking

logger = logging.getLogger(__name__)

T = TypeVar("T")

_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_STRONG_LOCKS: dict[int, tuple[Any, threading.RLock]] = {}
_LOCKS_GUARD = threading.Lock()
_warned = False


def vector_store_of(retriever: Any) -> Any:
    """The vector store a retriever reads (``VectorIndexRetriever`` keeps it in
    ``_vector_store``), or ``None``.
    """
    return getattr(retriever, "_vector_store", None)


def sync_client(store: Any) -> Any:
    """The client of a store that has a synchronous client and no async one, else ``None``.

    Recognised by the Qdrant store's ``client`` property and its ``_aclient`` (``None`` when it
    was built with ``client=`` only).
    """
    if store is None or getattr(store, "_aclient", True) is not None:
        return None
    return getattr(store, "client", None)


@contextlib.contextmanager
def client_lock(store: Any) -> Iterator[None]:
    """Hold the lock of ``store``'s sync-only client (nothing to hold for other stores)."""
    client = sync_client(store)
    if client is None:
        yield
        return
    with _LOCKS_GUARD:
        try:
            lock = _LOCKS.setdefault(client, threading.RLock())
        except TypeError:  # a client that cannot be weakly referenced: keep its lock for good
            lock = _STRONG_LOCKS.setdefault(id(client), (client, threading.RLock()))[1]
    with lock:
        yield


async def in_thread(store: Any, func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """``func(*args, **kwargs)`` (a synchronous read of ``store``) in a worker thread, holding
    the client's lock; logged once per process.
    """
    global _warned
    if not _warned:
        _warned = True
        logger.info(
            "%s has no async client: async reads run its sync client in a worker thread, one "
            "call at a time (pass QdrantVectorStore(aclient=AsyncQdrantClient(...)) for native "
            "async reads)",
            type(store).__name__,
        )

    def locked() -> T:
        with client_lock(store):
            return func(*args, **kwargs)

    return await run_blocking(locked)
