"""Reading chunks back: a real SimpleDocumentStore and Qdrant local mode, sync and async."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from llama_index.core.storage.docstore import SimpleDocumentStore

from llama_index.packs.self_rag_rse.rse.chunk_sources import ChunkRequest, ChunkSource


@pytest.fixture
def chunks(doc_nodes):
    nodes = doc_nodes("alpha", 6) + doc_nodes("beta", 4)
    for i, node in enumerate(nodes):
        node.id_ = uid(node.node_id)  # Qdrant takes UUIDs only
        node.embedding = [1.0, float(i), 0.5, 0.25]  # and a vector per point
    return nodes


@pytest.fixture
def qdrant(chunks):
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="sources")
    store.add([n.model_copy(deep=True) for n in chunks])
    return store


def uid(name: str) -> str:
    return str(uuid.uuid5(uuid.NAMESPACE_URL, name))


def ids(nodes):
    return sorted(n.node_id for n in nodes)


def named(*names: str) -> list[str]:
    return sorted(uid(name) for name in names)


def test_docstore_answers_records_and_ids(chunks, docstore_with):
    source = ChunkSource(docstore=docstore_with(chunks))
    assert source.supports("ref_doc_ids") and not source.supports("chunk_indices")
    records = source.run(ChunkRequest("ref_doc_ids", doc_ids=["alpha", "beta", "gamma"]))
    assert records["alpha"] == [uid(f"alpha-{i}") for i in range(6)]
    assert "gamma" not in records
    wanted = [uid("alpha-2"), uid("beta-3"), uid("nowhere")]
    read = source.run(ChunkRequest("node_ids", node_ids=wanted))
    assert ids(n for n in read if n is not None) == named("alpha-2", "beta-3")
    assert source.calls == 2


def test_qdrant_answers_chunk_indices_and_documents(chunks, qdrant):
    source = ChunkSource(vector_store=qdrant)
    assert source.supports("chunk_indices") and not source.supports("ref_doc_ids")
    request = ChunkRequest("chunk_indices", indices={"alpha": [1, 4], "beta": [0]})
    assert ids(source.run(request)) == named("alpha-1", "alpha-4", "beta-0")
    documents = source.run(ChunkRequest("documents", doc_ids=["beta"], limit=100))
    assert ids(documents) == named(*(f"beta-{i}" for i in range(4)))
    by_id = ChunkRequest("node_ids", node_ids=[uid("alpha-5")])
    assert ids(source.run(by_id)) == named("alpha-5")


def test_async_reads_match_sync(chunks, qdrant, docstore_with):
    store = docstore_with(chunks)
    request = ChunkRequest("node_ids", node_ids=[uid("alpha-0"), uid("beta-1")])

    async def both():
        from llama_index.vector_stores.qdrant import QdrantVectorStore
        from qdrant_client import AsyncQdrantClient

        aqdrant = QdrantVectorStore(
            aclient=AsyncQdrantClient(location=":memory:"), collection_name="asources"
        )
        await aqdrant.async_add([n.model_copy(deep=True) for n in chunks])
        by_index = ChunkRequest("chunk_indices", indices={"alpha": [3]})
        return (
            await ChunkSource(docstore=store).arun(request),
            await ChunkSource(vector_store=aqdrant).arun(by_index),
        )

    from_docstore, from_qdrant = asyncio.run(both())
    assert ids(from_docstore) == ids(ChunkSource(docstore=store).run(request))
    assert ids(from_qdrant) == named("alpha-3")


def test_async_reads_by_id_use_the_async_clients_retrieve(chunks):
    """Ids are read with the async client's ``retrieve`` (a scroll scans every point)."""
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import AsyncQdrantClient

    async def read():
        aclient = AsyncQdrantClient(location=":memory:")
        store = QdrantVectorStore(aclient=aclient, collection_name="byid")
        await store.async_add([n.model_copy(deep=True) for n in chunks])
        calls = []
        scroll, retrieve = aclient.scroll, aclient.retrieve

        async def counting_retrieve(*args, **kwargs):
            calls.append("retrieve")
            return await retrieve(*args, **kwargs)

        async def counting_scroll(*args, **kwargs):
            calls.append("scroll")
            return await scroll(*args, **kwargs)

        aclient.retrieve, aclient.scroll = counting_retrieve, counting_scroll
        request = ChunkRequest("node_ids", node_ids=[uid("alpha-2"), uid("beta-3")])
        return await ChunkSource(vector_store=store).arun(request), calls

    nodes, calls = asyncio.run(read())
    assert ids(nodes) == named("alpha-2", "beta-3")
    assert calls == ["retrieve"]


def test_a_failing_store_is_logged_with_its_name_and_reads_nothing(caplog):
    class Broken(SimpleDocumentStore):
        def get_ref_doc_info(self, ref_doc_id):
            raise ConnectionError("docstore offline")

    source = ChunkSource(docstore=Broken())
    with caplog.at_level(logging.WARNING):
        assert source.run(ChunkRequest("ref_doc_ids", doc_ids=["alpha"])) == {}
    assert "Broken" in caplog.text and "docstore offline" in caplog.text and "Fix:" in caplog.text


def test_unknown_request_kind_is_an_error(qdrant, caplog):
    source = ChunkSource(vector_store=qdrant)
    with caplog.at_level(logging.WARNING):
        assert source.run(ChunkRequest("everything")) == []
    assert "unknown chunk request kind" in caplog.text
