"""Which stores are read in a worker thread, and that their calls never overlap."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from llama_index.packs.self_rag_rse.common.stores import (
    client_lock,
    in_thread,
    sync_client,
    vector_store_of,
)


def test_only_a_store_without_an_async_client_is_sync_only() -> None:
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import AsyncQdrantClient, QdrantClient

    sync_only = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="a")
    asynced = QdrantVectorStore(aclient=AsyncQdrantClient(location=":memory:"), collection_name="b")
    assert sync_client(sync_only) is sync_only.client
    assert sync_client(asynced) is None
    assert sync_client(None) is None and sync_client(object()) is None


def test_the_vector_store_of_an_index_retriever_is_found() -> None:
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="c")
    index = VectorStoreIndex(
        [],
        storage_context=StorageContext.from_defaults(vector_store=store),
        embed_model=MockEmbedding(embed_dim=4),
    )
    assert vector_store_of(index.as_retriever()) is store


class FakeStore:
    """A store whose client is sync-only, as Qdrant's is without ``aclient``."""

    _aclient = None

    def __init__(self) -> None:
        self.client = object()
        self.active = 0
        self.most = 0
        self.guard = threading.Lock()

    def read(self, value: Any) -> Any:
        with self.guard:
            self.active += 1
            self.most = max(self.most, self.active)
        time.sleep(0.02)
        with self.guard:
            self.active -= 1
        return value


def test_reads_of_one_client_never_overlap_async_or_sync() -> None:
    store = FakeStore()

    async def many() -> list[int]:
        return list(await asyncio.gather(*(in_thread(store, store.read, i) for i in range(6))))

    def sync_reader() -> None:
        with client_lock(store):
            store.read(-1)

    thread = threading.Thread(target=sync_reader)
    thread.start()
    assert asyncio.run(many()) == list(range(6))
    thread.join()
    assert store.most == 1
