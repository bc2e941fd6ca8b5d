"""Retrieval for the Self-RAG flow: the retriever, then the engine's postprocessors, with what a
retriever or postprocessor returned checked and named.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from llama_index.packs.self_rag_rse.common.bridge import run_blocking
from llama_index.packs.self_rag_rse.common.notes import collect_notes
from llama_index.packs.self_rag_rse.common.stores import in_thread, sync_client, vector_store_of

logger = logging.getLogger(__name__)


@dataclass
class Retrieval:
    """Nodes after retrieval and post-processing, and who dropped them all (if anyone did)."""

    nodes: list[NodeWithScore]
    retrieved: int = 0
    dropped_by: str | None = None
    note: str | None = None


def node_text(item: NodeWithScore) -> str:
    """The node's text alone (no metadata): what decides whether a paragraph is empty."""
    return item.node.get_content(metadata_mode=MetadataMode.NONE)


def paragraph_text(item: NodeWithScore, title_key: str | Sequence[str] | None) -> str:
    """The paragraph the critic reads: an optional title line (the first non-empty value of the
    ``title_key`` metadata keys), then the node's text. A lone surrogate (bytes read with
    ``errors="surrogateescape"``) cannot be encoded for any model: it reads as U+FFFD.
    """
    text = node_text(item)
    keys = [title_key] if isinstance(title_key, str) else list(title_key or [])
    for key in keys:
        title = item.node.metadata.get(key)
        if title is not None and str(title).strip():
            text = f"{str(title).strip()}\n{text}"
            break
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def checked_nodes(nodes: Any, source: Any) -> list[NodeWithScore]:
    """``nodes`` as a list, or a ``TypeError`` naming the retriever or postprocessor that
    returned something other than a list of ``NodeWithScore``.
    """
    name = type(source).__name__
    if nodes is None or isinstance(nodes, (str, bytes)) or not hasattr(nodes, "__iter__"):
        raise TypeError(
            f"{name} returned {type(nodes).__name__}: a retriever or postprocessor must return "
            "a list of NodeWithScore (an empty list when nothing matches)"
        )
    nodes = list(nodes)
    wrong = next((n for n in nodes if not isinstance(n, NodeWithScore)), None)
    if wrong is not None:
        raise TypeError(
            f"{name} returned a {type(wrong).__name__} among its nodes: a retriever or "
            "postprocessor must return NodeWithScore objects (wrap nodes with NodeWithScore)"
        )
    return nodes


@contextmanager
def _retriever_errors(retriever: Any) -> Iterator[None]:
    """Name the retriever in a type error from core's handling of what it returned (core
    iterates the nodes before we see them: a ``_retrieve`` returning ``None`` fails there); an
    error raised inside the retriever's own work goes on unchanged.
    """
    try:
        yield
    except (TypeError, AttributeError) as error:
        frames = traceback.extract_tb(error.__traceback__)
        # Core's handling of what a retriever returned (it iterates the nodes).
        raised_by_core = any(f.name.endswith("handle_recursive_retrieval") for f in frames)
        already_named = str(error).startswith(type(retriever).__name__)
        if already_named or not raised_by_core:
            raise  # ours; or the retriever's own failure, as it is
        raise TypeError(
            f"{type(retriever).__name__} failed while retrieving ({type(error).__name__}: "
            f"{error}); a retriever must return a list of NodeWithScore (an empty list when "
            "nothing matches), not None or bare nodes"
        ) from error


async def retrieve(
    retriever: Any, postprocessors: Sequence[Any], text: str, *, blocking: bool, bundle: Any = None
) -> Retrieval:
    """Retrieve for ``text`` and run the postprocessors, noting one that dropped every node.

    ``blocking`` (a synchronous query) calls their blocking methods, in worker threads: a
    retriever without async support works, and the event loop stays free meanwhile. ``bundle``:
    the caller's ``QueryBundle``, used whole (its ``custom_embedding_strs`` or ``embedding``,
    e.g. HyDE's) when ``text`` is its question; a rewrite gets a bundle of its own.
    """
    bundle = bundle if getattr(bundle, "query_str", None) == text else QueryBundle(text)
    store = vector_store_of(retriever)
    with _retriever_errors(retriever):
        # A store with only a sync client fails every async call: its sync one runs in a thread.
        if sync_client(store) is not None:
            found = await in_thread(store, retriever.retrieve, bundle)
        elif blocking:
            found = await run_blocking(retriever.retrieve, bundle)
        else:
            found = await retriever.aretrieve(bundle)
        nodes = checked_nodes(found, retriever)
    kept = nodes
    dropped_by = None
    with collect_notes() as notes:
        for post in postprocessors:
            before = len(kept)
            if blocking:
                done = await run_blocking(post.postprocess_nodes, kept, query_bundle=bundle)
            else:
                done = await post.apostprocess_nodes(kept, query_bundle=bundle)
            kept = checked_nodes(done, post)
            # The first postprocessor that was given nodes and kept none is the one to name.
            if before > 0 and not kept and dropped_by is None:
                dropped_by = type(post).__name__
    note = None
    if dropped_by is not None:
        reasons = [reason for source, reason in notes if source == dropped_by]
        because = f": {reasons[0]}" if reasons else ""
        note = f"{dropped_by} kept none of the {len(nodes)} retrieved nodes{because}"
        logger.info("%s", note)
    return Retrieval(nodes=kept, retrieved=len(nodes), dropped_by=dropped_by, note=note)
