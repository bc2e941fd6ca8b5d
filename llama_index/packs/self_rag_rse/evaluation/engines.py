"""What is evaluated: the index (built as ``benchmarks/bench_rse_quality.py`` builds its own),
and the five engines compared on it, which share the retriever settings and the LLM, so the
differences are the techniques' (:data:`ENGINE_DESCRIPTIONS`).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from llama_index.core import Document, StorageContext, VectorStoreIndex
from llama_index.core.base.base_query_engine import BaseQueryEngine
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import BaseNode, TransformComponent

from llama_index.packs.self_rag_rse.common.optional import optional_import
from llama_index.packs.self_rag_rse.evaluation.names import ENGINE_DESCRIPTIONS, ENGINE_NAMES
from llama_index.packs.self_rag_rse.rse.chunk_index import ChunkIndexer
from llama_index.packs.self_rag_rse.rse.postprocessor import RelevantSegmentPostprocessor
from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine

#: The command's chunk size in tokens: as the demo's.
CHUNK_SIZE = 128
#: Tokens each chunk shares with the one before it.
CHUNK_OVERLAP = 16


@dataclass
class BuiltIndex:
    """An index, its chunks and vector store, and seconds spent preparing and embedding."""

    index: VectorStoreIndex
    nodes: list[BaseNode]
    store: Any
    prepare_s: float
    embed_s: float


def build_index(
    documents: Sequence[Document],
    embed_model: Any,
    transformations: Sequence[TransformComponent] | None = None,
    *,
    collection: str = "evaluation",
) -> BuiltIndex:
    """Chunk copies of ``documents`` (default: ``SentenceSplitter`` and ``ChunkIndexer``, whose
    chunk indexes RSE reads), embed them, store them in a fresh in-memory Qdrant collection.
    """
    qdrant = optional_import("llama_index.vector_stores.qdrant", "the evaluation index")
    client = optional_import("qdrant_client", "the evaluation index")
    if transformations is None:
        splitter = SentenceSplitter(chunk_size=CHUNK_SIZE, chunk_overlap=CHUNK_OVERLAP)
        transformations = [splitter, ChunkIndexer(stable_ids=True)]
    started = time.perf_counter()
    # Copies: a transformation may write metadata, and callers build several indexes.
    nodes = IngestionPipeline(transformations=list(transformations), disable_cache=True).run(
        documents=[d.model_copy(deep=True) for d in documents]
    )
    prepared = time.perf_counter()
    nodes = embed_model(nodes)
    embedded = time.perf_counter()
    store = qdrant.QdrantVectorStore(
        client=client.QdrantClient(location=":memory:"), collection_name=collection
    )
    with warnings.catch_warnings():
        # ChunkIndexer's payload index: Qdrant local mode warns that it scans instead.
        warnings.filterwarnings("ignore", message="Payload indexes have no effect")
        storage = StorageContext.from_defaults(vector_store=store)
        index = VectorStoreIndex(nodes, storage_context=storage, embed_model=embed_model)
    return BuiltIndex(
        index=index,
        nodes=nodes,
        store=store,
        prepare_s=prepared - started,
        embed_s=embedded - prepared,
    )


def default_engines(
    index: Any,
    llm: Any,
    *,
    similarity_top_k: int = 8,
    engines: Sequence[str] | None = None,
    rse_options: Mapping[str, Any] | None = None,
    self_rag_options: Mapping[str, Any] | None = None,
) -> dict[str, BaseQueryEngine]:
    """The engines of :data:`ENGINE_NAMES` (or the subset ``engines``) on ``index`` and ``llm``;
    ``rse_options`` go to ``RelevantSegmentPostprocessor``, ``self_rag_options`` to the
    ``SelfRAGQueryEngine``. Self-RAG engines own their critic: :func:`close_engines` when done.
    """
    names = list(engines) if engines is not None else list(ENGINE_NAMES)
    if unknown := [n for n in names if n not in ENGINE_DESCRIPTIONS]:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {list(ENGINE_NAMES)}")
    if similarity_top_k < 1:
        raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
    if "corrective" in (self_rag_options or {}):
        raise ValueError(
            "self_rag_options must not set corrective: it is set per engine (on in "
            "self-rag+corrective, off in the others); remove it from self_rag_options"
        )
    built: dict[str, BaseQueryEngine] = {}
    try:
        for name in names:
            retriever = index.as_retriever(similarity_top_k=similarity_top_k)
            post: list[Any] = []
            if name.endswith("+rse"):
                post.append(RelevantSegmentPostprocessor(index=index, **dict(rse_options or {})))
            if name.startswith("top-k"):
                built[name] = RetrieverQueryEngine.from_args(
                    retriever, llm=llm, node_postprocessors=post
                )
            else:
                options = {**(self_rag_options or {}), "corrective": name.endswith("corrective")}
                built[name] = SelfRAGQueryEngine.from_args(
                    retriever, llm, node_postprocessors=post, **options
                )
    except BaseException:
        close_engines(built)
        raise
    return built


def close_engines(engines: Mapping[str, Any]) -> None:
    """Close every engine that has ``close()`` (Self-RAG engines free their critics)."""
    for engine in engines.values():
        if callable(close := getattr(engine, "close", None)):
            close()
