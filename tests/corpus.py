"""The shipped corpus and a Qdrant local-mode index over it, for the segment-extraction tests."""

from __future__ import annotations

import os
from pathlib import Path

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


def qdrant_index(nodes, minilm, *, keep_chunk_index: bool = True, collection: str = "rse"):
    """A VectorStoreIndex over Qdrant local mode (in memory) with no docstore."""
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    nodes = [n.model_copy(deep=True) for n in nodes]
    if not keep_chunk_index:
        for node in nodes:
            node.metadata.pop("chunk_index", None)
    # Local mode has no payload indexes: asking for one only warns.
    store = QdrantVectorStore(
        client=QdrantClient(location=":memory:"), collection_name=collection, index_doc_id=False
    )
    storage = StorageContext.from_defaults(vector_store=store)
    return VectorStoreIndex(nodes, storage_context=storage, embed_model=minilm)


def unlinked(nodes):
    """Copies of ``nodes`` without NEXT/PREVIOUS links (offsets and indices kept)."""
    from llama_index.core.schema import NodeRelationship

    nodes = [n.model_copy(deep=True) for n in nodes]
    for node in nodes:
        node.relationships.pop(NodeRelationship.NEXT, None)
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
    return nodes
