"""Retrievers and nodes shared by the engine tests (the retriever is not under test there)."""

from __future__ import annotations

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode

PARAGRAPHS = [
    ("p-while", "The while statement repeats a suite while an expression is true.", "while"),
    ("p-for", "The for statement iterates over the items of a sequence.", "for"),
    ("p-if", "The if statement selects exactly one suite by evaluating expressions.", None),
]


class FixedRetriever(BaseRetriever):
    """Returns the same scored nodes for every query (the retriever is not under test here)."""

    def __init__(self, nodes: list[NodeWithScore] | None = None) -> None:
        super().__init__()
        self.nodes = nodes if nodes is not None else make_nodes()
        self.queries: list[str] = []
        self.bundles: list[QueryBundle] = []

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        self.queries.append(query_bundle.query_str)
        self.bundles.append(query_bundle)
        return [NodeWithScore(node=n.node, score=n.score) for n in self.nodes]


def make_nodes() -> list[NodeWithScore]:
    out = []
    for i, (node_id, text, title) in enumerate(PARAGRAPHS):
        metadata = {"title": title, "source": "unit"} if title else {"source": "unit"}
        out.append(
            NodeWithScore(
                node=TextNode(id_=node_id, text=text, metadata=metadata), score=0.9 - 0.1 * i
            )
        )
    return out


class RoutingRetriever(BaseRetriever):
    """Returns the paragraphs listed for each search text (node id = text, no title)."""

    def __init__(self, routes: dict[str, list[str]]) -> None:
        super().__init__()
        self.routes = routes
        self.queries: list[str] = []

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        self.queries.append(query_bundle.query_str)
        return routed_nodes(self.routes.get(query_bundle.query_str, []))


def routed_nodes(texts: list[str]) -> list[NodeWithScore]:
    """One scored node per text, its id the text itself (so traces read plainly)."""
    return [NodeWithScore(node=TextNode(id_=text, text=text), score=1.0) for text in texts]
