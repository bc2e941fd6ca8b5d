"""Fixtures shared by the RSE tests: Qdrant local-mode indexes, synthetic and real chunks."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest
from corpus import CORPUS, corpus_documents, qdrant_index
from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore
from text_strategies import same_but_whitespace


@pytest.fixture(scope="session")
def indexed(corpus_nodes: Any, minilm: Any) -> Any:
    """The corpus in Qdrant local mode, chunk indices stamped, no docstore."""
    return qdrant_index(corpus_nodes, minilm, collection="indexed")


@pytest.fixture(scope="session")
def unindexed(corpus_nodes: Any, minilm: Any) -> Any:
    """The corpus in Qdrant local mode without chunk indices, no docstore."""
    return qdrant_index(corpus_nodes, minilm, keep_chunk_index=False, collection="plain")


def _doc_nodes(doc_id: str, n: int, *, indexed: bool = True, text_len: int = 20) -> list[TextNode]:
    nodes = []
    for i in range(n):
        text = f"{doc_id}-{i:06d}".ljust(text_len, ".")
        node = TextNode(
            id_=f"{doc_id}-{i}",
            text=text,
            start_char_idx=i * text_len,
            end_char_idx=(i + 1) * text_len,
            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=doc_id)},
        )
        if indexed:
            node.metadata["chunk_index"] = i
        nodes.append(node)
    for a, b in itertools.pairwise(nodes):
        a.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=b.node_id)
        b.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=a.node_id)
    return nodes


@pytest.fixture(scope="session")
def doc_nodes() -> Callable[..., list[TextNode]]:
    """``doc_nodes(doc_id, n, indexed=True, text_len=20)``: n consecutive synthetic chunks of one
    document with exact offsets, NEXT/PREVIOUS links and (optionally) chunk indices.
    """
    return _doc_nodes


@pytest.fixture(scope="session")
def docstore_with() -> Callable[[list[Any]], SimpleDocumentStore]:
    """``docstore_with(nodes)``: a SimpleDocumentStore holding ``nodes``, recording per document
    which nodes it has (``get_ref_doc_info``), as an index's docstore does.
    """

    def build(nodes: list[Any]) -> SimpleDocumentStore:
        store = SimpleDocumentStore()
        store.add_documents(nodes)
        return store

    return build


@pytest.fixture(scope="session")
def source_text() -> Callable[[str], str]:
    """``source_text(doc_id)``: the text of a shipped corpus document."""
    return lambda doc_id: (CORPUS / f"{doc_id}.txt").read_text()


@pytest.fixture(scope="session")
def split() -> Callable[..., list[Any]]:
    """``split(chunk_size, chunk_overlap, name="execmodel")``: one corpus document cut by the real
    SentenceSplitter (offsets and NEXT/PREVIOUS links as LlamaIndex sets them), not embedded.
    """
    from llama_index.core.node_parser import SentenceSplitter

    def run(chunk_size: int, chunk_overlap: int, name: str = "execmodel") -> list[Any]:
        splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=chunk_overlap)
        return splitter.get_nodes_from_documents(corpus_documents((name,)))

    return run


@pytest.fixture(scope="session")
def whitespace_equal() -> Callable[[str, str], bool]:
    """:func:`same_but_whitespace` as a fixture."""
    return same_but_whitespace
