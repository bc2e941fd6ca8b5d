"""The engine's units of work and the small pure helpers of its flow.

The flow (:meth:`SelfRAGQueryEngine._flow`) yields :class:`Step` requests; the drivers answer
them with blocking or awaited calls to the retriever, the postprocessors and the critic.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from llama_index.packs.self_rag_rse.common.notes import collect_notes
from llama_index.packs.self_rag_rse.self_rag.trace import Candidate

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """One unit of work the drivers execute: ``kind`` is decide, retrieve, judge or generate."""

    kind: str
    text: str
    paragraphs: Sequence[str] = ()


@dataclass
class Retrieved:
    """Nodes after retrieval and post-processing, and who dropped them all (if anyone did)."""

    nodes: list[NodeWithScore]
    retrieved: int = 0
    dropped_by: str | None = None
    note: str | None = None
    notes: list[tuple[str, str]] = field(default_factory=list)


def node_text(item: NodeWithScore) -> str:
    return item.node.get_content(metadata_mode=MetadataMode.NONE)


def check_query(query: Any) -> None:
    """Reject what cannot be a question before any event or model call sees it."""
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str):
        raise TypeError(
            f"query must be a string or a QueryBundle, got {type(query).__name__}: "
            "pass the question as text, e.g. engine.query('What is ...?')"
        )
    if not text.strip():
        raise ValueError("query is empty: pass a non-empty question")


def retrieve(retriever: Any, postprocessors: Sequence[Any], text: str) -> Retrieved:
    """Retrieve for ``text`` and run the postprocessors, noting one that dropped every node."""
    bundle = QueryBundle(text)
    nodes = retriever.retrieve(bundle)
    with collect_notes() as notes:
        kept, dropped_by = list(nodes), None
        for post in postprocessors:
            before = len(kept)
            kept = post.postprocess_nodes(kept, query_bundle=bundle)
            if before and not kept and dropped_by is None:
                dropped_by = type(post).__name__
    return retrieved_nodes(nodes, kept, dropped_by, notes)


async def aretrieve(retriever: Any, postprocessors: Sequence[Any], text: str) -> Retrieved:
    """Async :func:`retrieve`."""
    bundle = QueryBundle(text)
    nodes = await retriever.aretrieve(bundle)
    with collect_notes() as notes:
        kept, dropped_by = list(nodes), None
        for post in postprocessors:
            before = len(kept)
            kept = await post.apostprocess_nodes(kept, query_bundle=bundle)
            if before and not kept and dropped_by is None:
                dropped_by = type(post).__name__
    return retrieved_nodes(nodes, kept, dropped_by, notes)


def retrieved_nodes(
    nodes: list[NodeWithScore],
    kept: list[NodeWithScore],
    dropped_by: str | None,
    notes: list[tuple[str, str]],
) -> Retrieved:
    note = None
    if dropped_by is not None:
        reasons = [text for source, text in notes if source == dropped_by]
        note = f"{dropped_by} kept none of the {len(nodes)} retrieved nodes" + (
            f": {reasons[0]}" if reasons else ""
        )
        logger.info("%s", note)
    return Retrieved(kept, len(nodes), dropped_by, note, list(notes))


def no_nodes_reason(trace: list[dict[str, Any]]) -> str:
    """Why there was nothing to judge, from the last retrieval's trace entry."""
    last = next((e for e in reversed(trace) if e.get("step") == "retrieve"), None)
    if last is not None and last.get("dropped_by"):
        return str(last["reason"])
    if any(e.get("step") == "skip_empty" for e in trace):
        return "every retrieved paragraph was empty"
    return "retriever returned no nodes"


def best_candidate(candidates: list[Candidate]) -> Candidate | None:
    """Highest-scoring paragraph with an answer (an empty answer cannot be the response)."""
    usable = [c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()]
    return max(usable, key=lambda c: c.score) if usable else None
