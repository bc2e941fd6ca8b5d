"""Per-document cache of LLM results, so re-ingesting unchanged documents costs no LLM call.

``IngestionPipeline``'s own cache keys a transformation's output on *all* the nodes it was given:
change one document of a thousand and every document is sent to the LLM again. The context
components therefore cache each LLM result on its own, keyed by a hash of the text it was
computed from, the kind of result, the model (class and name) and the settings that shape it.

The store is any LlamaIndex key-value store (``SimpleKVStore`` in memory by default; Redis,
MongoDB, Postgres, ... through their integration packages), or a folder, which keeps a
``SimpleKVStore`` persisted as ``<folder>/context_cache.json``. Several components may share one
cache: their entries live in separate collections. The file is replaced atomically (written
beside it, then renamed over it), so a crash mid-write leaves the previous cache whole; a file
that is damaged all the same (cut short by another tool, edited by hand) is named in a warning
and the cache starts empty: its entries are computed again, and the next write replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import Any

from llama_index.core.storage.kvstore import SimpleKVStore
from llama_index.core.storage.kvstore.types import BaseKVStore

logger = logging.getLogger(__name__)

CACHE_FILE_NAME = "context_cache.json"
_COLLECTION_PREFIX = "self_rag_rse_context"


class ContextCache:
    """LLM results keyed by content hash, in a LlamaIndex key-value store.

    Example::

        cache = ContextCache.from_dir("./context_cache")   # or ContextCache(RedisKVStore(...))
        sectioner = DocumentSectioner(strategy="llm", llm=llm, cache=cache)
        headers = ContextualHeaders(llm=llm, document_summary=True, cache=cache)
    """

    def __init__(self, store: BaseKVStore | None = None, persist_path: str | None = None) -> None:
        self.store: BaseKVStore = store if store is not None else SimpleKVStore()
        self.persist_path = persist_path
        self._dirty = False

    @classmethod
    def from_dir(cls, folder: str | os.PathLike[str]) -> ContextCache:
        """A cache kept in ``folder`` (created when missing), loaded if it exists; a damaged
        file is warned about (with its path) and the cache starts empty.
        """
        if Path(folder).is_file():  # it would be ignored, then be unwritable after the LLM work
            raise ValueError(
                f"cache {str(folder)!r} is a file: pass its folder, cache='{Path(folder).parent}'"
            )
        path = Path(folder) / CACHE_FILE_NAME
        return cls(_load(path), persist_path=str(path))

    @classmethod
    def coerce(cls, value: Any) -> ContextCache:
        """A cache from what a constructor was given: a cache, a key-value store, a folder, or
        ``None`` (a fresh in-memory cache).
        """
        if value is None:
            return cls()
        if isinstance(value, ContextCache):
            return value
        if isinstance(value, BaseKVStore):
            return cls(value)
        if isinstance(value, (str, os.PathLike)):
            return cls.from_dir(value)
        raise TypeError(
            f"cache must be a ContextCache, a LlamaIndex BaseKVStore, a folder path or None, "
            f"got {type(value).__name__}"
        )

    @staticmethod
    def key(*parts: Any) -> str:
        """A stable key for the parts (texts, names, settings)."""
        digest = hashlib.sha256()
        for part in parts:
            encoded = part if isinstance(part, str) else json.dumps(part, sort_keys=True)
            digest.update(encoded.encode("utf-8", "surrogatepass"))
            digest.update(b"\x00")
        return digest.hexdigest()

    async def aget(self, kind: str, key: str) -> dict[str, Any] | None:
        """The cached entry of ``kind`` under ``key``, or ``None``."""
        return await self.store.aget(key, collection=f"{_COLLECTION_PREFIX}/{kind}")

    async def aput(self, kind: str, key: str, value: dict[str, Any]) -> None:
        """Cache ``value`` (a JSON-able dict)."""
        await self.store.aput(key, value, collection=f"{_COLLECTION_PREFIX}/{kind}")
        self._dirty = True

    def persist(self) -> None:
        """Write the cache to its folder, if it has one and something new was cached.

        Atomic: the store is written to a temporary file in the same folder, flushed to disk and
        renamed over the old file, so an interrupted write never leaves half a file behind.
        """
        if self.persist_path is None or not self._dirty:
            return
        persist = getattr(self.store, "persist", None)
        if persist is not None:
            path = Path(self.persist_path)
            if isinstance(self.store, SimpleKVStore) and path.is_file():
                # Another cache of this folder (a second component given the same path, another
                # process) may have written since this one loaded: keep its entries too.
                for collection, entries in _load(path).to_dict().items():
                    mine = self.store.get_all(collection)
                    for key in entries.keys() - mine.keys():
                        self.store.put(key, entries[key], collection=collection)
            path.parent.mkdir(parents=True, exist_ok=True)
            # Same folder: a rename within one file system is atomic.
            temporary = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
            try:
                persist(str(temporary))
                with temporary.open("rb+") as handle:
                    os.fsync(handle.fileno())
                os.replace(temporary, path)
            except BaseException:  # a crash (KeyboardInterrupt too) leaves the old file alone
                with contextlib.suppress(OSError):
                    temporary.unlink()
                raise
        self._dirty = False


def _load(path: Path) -> SimpleKVStore:
    """The store kept at ``path``: empty when there is none, or when it is damaged (warned)."""
    if not path.is_file():
        return SimpleKVStore()
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        problem = f"{type(exc).__name__}: {exc}"
    else:
        if _well_formed(data):
            return SimpleKVStore(data)
        problem = "not an object of collections of JSON objects"
    logger.warning(
        "context cache %s is damaged (%s; a write cut short?): starting with an empty cache, "
        "so its entries are computed again; the next write replaces the file",
        path,
        problem,
    )
    return SimpleKVStore()


def _well_formed(data: Any) -> bool:
    """Whether ``data`` has the shape a ``SimpleKVStore`` file has: collection -> key -> object."""
    return isinstance(data, dict) and all(
        isinstance(entries, dict) and all(isinstance(v, dict) for v in entries.values())
        for entries in data.values()
    )


def model_id(llm: Any) -> str:
    """The model an LLM runs, for cache keys: its class and its model name."""
    try:
        name = str(llm.metadata.model_name)
    except Exception:  # an LLM without metadata still gets a key, by class alone
        name = ""
    return f"{type(llm).__name__}:{name}"
