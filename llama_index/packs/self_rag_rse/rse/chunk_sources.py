"""Where the postprocessor reads chunks that retrieval did not return.

A :class:`ChunkRequest` says what is needed (a document's ordered node ids, nodes by id, nodes by
chunk index, or whole documents); :class:`ChunkSource` answers it from a docstore or a vector
store, synchronously or asynchronously, as one batched call per request. Keeping the requests as
data lets the segment logic be written once and driven by either a sync or an async loop.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.schema import BaseNode
from llama_index.core.storage.docstore.types import BaseDocumentStore
from llama_index.core.vector_stores.types import (
    BasePydanticVectorStore,
    FilterCondition,
    FilterOperator,
    MetadataFilter,
    MetadataFilters,
)

from llama_index.packs.self_rag_rse.common.stores import client_lock, in_thread, sync_client
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY

logger = logging.getLogger(__name__)

#: Most chunks a read by chunk index asks for per index: a store can hold several chunks with
#: one index (copies from re-ingests without stable ids), which the reader must see to choose.
MAX_COPIES_READ = 8

#: Vector-store payload key of a node's source document (LlamaIndex writes ``doc_id``,
#: ``document_id`` and ``ref_doc_id``).
DOC_ID_KEY = "doc_id"


@dataclass
class ChunkRequest:
    """One batched read. ``kind`` is one of:

    - ``"ref_doc_ids"``: ordered node ids of each document in ``doc_ids`` (docstore only);
    - ``"node_ids"``: the nodes with ids ``node_ids``;
    - ``"chunk_indices"``: the nodes whose chunk index is in ``indices[doc_id]``;
    - ``"documents"``: every node of each document in ``doc_ids`` (at most ``limit``).
    """

    kind: str
    doc_ids: list[str] = field(default_factory=list)
    node_ids: list[str] = field(default_factory=list)
    indices: dict[str, list[int]] = field(default_factory=dict)
    limit: int | None = None


@dataclass
class ChunkSource:
    """Reads chunks from a docstore and/or a vector store.

    A store that fails a read is logged and treated as having returned nothing, so callers
    degrade instead of losing the query; ``calls`` counts reads for benchmarks and tests.
    """

    docstore: BaseDocumentStore | None = None
    vector_store: BasePydanticVectorStore | None = None
    calls: int = 0

    @property
    def can_read(self) -> bool:
        """Whether any store is attached."""
        return self.docstore is not None or self.vector_store is not None

    def supports(self, kind: str) -> bool:
        """Whether this source can answer requests of ``kind``."""
        if kind == "ref_doc_ids":
            return self.docstore is not None
        if kind in ("chunk_indices", "documents"):
            return self.vector_store is not None
        return self.can_read

    # -- sync -------------------------------------------------------------------------------
    def run(self, request: ChunkRequest) -> Any:
        """Answer ``request`` with blocking calls."""
        self.calls += 1
        with client_lock(self.vector_store):
            return self._run(request)

    def _run(self, request: ChunkRequest) -> Any:
        try:
            if request.kind == "ref_doc_ids":
                assert self.docstore is not None
                infos = {d: self.docstore.get_ref_doc_info(d) for d in request.doc_ids}
                return {d: list(i.node_ids) for d, i in infos.items() if i is not None}
            if request.kind == "node_ids" and self.docstore is not None:
                return self.docstore.get_nodes(request.node_ids, raise_error=False)
            assert self.vector_store is not None
            direct = direct_reader(self.vector_store) if request.kind == "node_ids" else None
            if direct is not None:
                return direct(request.node_ids)
            return self.vector_store.get_nodes(**self._arguments(request))
        except Exception as error:  # a store's own failure must not lose the query
            return self._failed(request, error)

    # -- async ------------------------------------------------------------------------------
    async def arun(self, request: ChunkRequest) -> Any:
        """Answer ``request`` with the stores' async APIs; a vector store with only a sync
        client is read with it in a worker thread (see ``common/stores.py``).
        """
        self.calls += 1
        if not self._by_docstore(request) and sync_client(self.vector_store) is not None:
            return await in_thread(self.vector_store, self._run, request)
        try:
            if request.kind == "ref_doc_ids":
                assert self.docstore is not None
                infos = {d: await self.docstore.aget_ref_doc_info(d) for d in request.doc_ids}
                return {d: list(i.node_ids) for d, i in infos.items() if i is not None}
            if request.kind == "node_ids" and self.docstore is not None:
                return await self.docstore.aget_nodes(request.node_ids, raise_error=False)
            assert self.vector_store is not None
            direct = (
                direct_reader(self.vector_store, asynchronous=True)
                if request.kind == "node_ids"
                else None
            )
            if direct is not None:
                return await direct(request.node_ids)
            return await self.vector_store.aget_nodes(**self._arguments(request))
        except Exception as error:
            return self._failed(request, error)

    # -- helpers ----------------------------------------------------------------------------
    def _limit(self, limit: int | None) -> dict[str, Any]:
        # get_nodes() takes no limit in the base class; stores that have one (Qdrant's default
        # is 9,999) would silently cut a larger read, so pass ours where it is accepted.
        store = self.vector_store
        accepted = store is not None and "limit" in inspect.signature(store.get_nodes).parameters
        return {"limit": limit} if limit is not None and accepted else {}

    def _arguments(self, request: ChunkRequest) -> dict[str, Any]:
        """The keyword arguments of the vector store's ``get_nodes`` for ``request``: the ids,
        or a metadata filter.
        """
        if request.kind == "node_ids":
            return {"node_ids": request.node_ids}
        if request.kind == "documents":
            return {
                "filters": MetadataFilters(
                    filters=[
                        MetadataFilter(
                            key=DOC_ID_KEY, value=request.doc_ids, operator=FilterOperator.IN
                        )
                    ]
                ),
                **self._limit(request.limit),
            }
        if request.kind == "chunk_indices":
            per_document: list[MetadataFilter | MetadataFilters] = [
                MetadataFilters(
                    filters=[
                        MetadataFilter(key=DOC_ID_KEY, value=doc_id),
                        MetadataFilter(
                            key=CHUNK_INDEX_KEY, value=indices, operator=FilterOperator.IN
                        ),
                    ],
                    condition=FilterCondition.AND,
                )
                for doc_id, indices in request.indices.items()
            ]
            # Room for copies of a chunk that re-ingests without stable ids left behind: they
            # must all come back to be told apart, not one of them taken by chance.
            needed = sum(len(v) for v in request.indices.values()) * MAX_COPIES_READ
            return {
                "filters": MetadataFilters(filters=per_document, condition=FilterCondition.OR),
                **self._limit(needed),
            }
        raise ValueError(f"unknown chunk request kind {request.kind!r}")

    def _by_docstore(self, request: ChunkRequest) -> bool:
        """Whether the docstore answers ``request``: id reads go to it when there is one."""
        return request.kind == "ref_doc_ids" or (
            request.kind == "node_ids" and self.docstore is not None
        )

    def _failed(self, request: ChunkRequest, error: Exception) -> Any:
        store = self.docstore if self._by_docstore(request) else self.vector_store
        logger.warning(
            "could not read %s from %s (%s: %s); segments will only join chunks already at "
            "hand. Fix: pass a docstore that holds the nodes, or a vector store whose "
            "get_nodes() supports node ids and metadata filters.",
            request.kind,
            type(store).__name__,
            type(error).__name__,
            error,
        )
        return {} if request.kind == "ref_doc_ids" else []


def direct_reader(store: Any, asynchronous: bool = False) -> Callable[[list[str]], Any] | None:
    """A reader of nodes by id that bypasses ``get_nodes`` where that is slow, else ``None``;
    ``asynchronous``: a coroutine function, through the store's async client.

    ``QdrantVectorStore.get_nodes(node_ids=...)`` is a scroll with an id filter, which Qdrant
    local mode answers by scanning every point in Python (64 ms at 10,000 points, measured);
    the client's ``retrieve`` reads the points directly (0.04 ms). Recognised by the public
    ``client``, ``collection_name`` and ``parse_to_query_result`` of the Qdrant store; its async
    client is ``_aclient`` (``None`` when the store was built with a sync client only: then its
    async methods fail, and so does this path's fallback).
    """
    client = getattr(store, "_aclient" if asynchronous else "client", None)
    collection = getattr(store, "collection_name", None)
    parse = getattr(store, "parse_to_query_result", None)
    retrieve = getattr(client, "retrieve", None)
    if not (callable(retrieve) and callable(parse) and isinstance(collection, str)):
        return None
    bound = functools.partial(
        retrieve, collection_name=collection, with_payload=True, with_vectors=False
    )

    async def aread(node_ids: list[str]) -> list[BaseNode]:
        return list(parse(await bound(ids=node_ids)).nodes)

    return aread if asynchronous else lambda node_ids: list(parse(bound(ids=node_ids)).nodes)
