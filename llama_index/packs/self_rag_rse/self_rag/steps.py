"""The engine's units of work and the small pure helpers of its flow.

The flow (:meth:`SelfRAGQueryEngine._flow`) yields :class:`Step` requests; the drivers answer
them with blocking or awaited calls to the retriever, the postprocessors and the critic.
"""

from __future__ import annotations

import logging
from collections.abc import (
    AsyncGenerator,
    AsyncIterable,
    AsyncIterator,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle

from llama_index.packs.self_rag_rse.common.notes import collect_notes
from llama_index.packs.self_rag_rse.common.options import require_finite
from llama_index.packs.self_rag_rse.common.stores import (
    client_lock,
    in_thread,
    sync_client,
    vector_store_of,
)
from llama_index.packs.self_rag_rse.self_rag.contract import ParagraphJudgement
from llama_index.packs.self_rag_rse.self_rag.trace import Candidate

logger = logging.getLogger(__name__)


@dataclass
class Step:
    """One unit of work the drivers execute: ``kind`` is decide, retrieve, judge or generate,
    and in long form start (a path's first context), write (one segment per ``branches``
    entry: a path's context and a paragraph) or emit (a decided piece of a streamed answer)."""

    kind: str
    text: str
    paragraphs: Sequence[str] = ()
    branches: Sequence[tuple[tuple[Any, ...], str]] = ()


@dataclass
class Outcome:
    """Where the flow ended: the answer (``None``: the model answers alone, with no evidence,
    and may stream it), the judged paragraphs, the metadata and the chosen paragraph; long
    form sets ``sources`` (the cited passages) instead of candidates."""

    answer: str | None
    candidates: list[Candidate]
    meta: dict[str, Any]
    best: Candidate | None = None
    sources: list[NodeWithScore] | None = None


def stream_answer(
    known: str | None, write: Callable[[str], Iterable[str]], query: str
) -> Iterator[str]:
    """The answer's pieces: a known answer in one piece, else ``write(query)``'s as they come."""
    if known is not None:
        yield known
    else:
        yield from write(query)


async def astream_answer(
    known: str | None, write: Callable[[str], AsyncIterable[str]], query: str
) -> AsyncIterator[str]:
    """Async :func:`stream_answer`."""
    if known is not None:
        yield known
    else:
        async for piece in write(query):
            yield piece


def unsent_rest(emitted: str, final: str) -> str:
    """What of the ``final`` answer a stream that already sent ``emitted`` still owes; when
    later tokens rewrote text already sent (detokenizing more bytes can), nothing more is sent
    and a warning shows both, so the difference is never silent."""
    if final.startswith(emitted):
        return final[len(emitted) :]
    logger.warning("streamed text %r is not a prefix of the final answer %r", emitted, final)
    return ""


def stripped(pieces: Iterable[str], final: Callable[[str], str]) -> Generator[str, None, None]:
    """``pieces`` with the answer's outer whitespace held back, so that they join to the
    stripped answer (what a non-streamed response holds); an answer that is all whitespace
    becomes ``final("")`` (the engine's no-answer text)."""
    holder = _Stripper()
    for piece in pieces:
        if text := holder.feed(piece):
            yield text
    if holder.empty:
        yield final("")


async def astripped(
    pieces: AsyncIterable[str], final: Callable[[str], str]
) -> AsyncGenerator[str, None]:
    """Async :func:`stripped`."""
    holder = _Stripper()
    async for piece in pieces:
        if text := holder.feed(piece):
            yield text
    if holder.empty:
        yield final("")


class _Stripper:
    """Leading whitespace dropped, trailing whitespace held until more text follows."""

    def __init__(self) -> None:
        self.empty = True
        self._pending = ""

    def feed(self, piece: str) -> str:
        if self.empty:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.empty = False
        text = self._pending + piece
        body = text.rstrip()
        self._pending = text[len(body) :]
        return body


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


def paragraph_text(item: NodeWithScore, title_key: str | Sequence[str] | None) -> str:
    """The paragraph the critic reads: an optional title line (the first non-empty value of the
    ``title_key`` metadata keys), then the node's text."""
    text = node_text(item)
    keys = [title_key] if isinstance(title_key, str) else (title_key or [])
    for key in keys:
        title = item.node.metadata.get(key)
        if title is not None and str(title).strip():
            return f"{str(title).strip()}\n{text}"
    return text


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


def check_options(engine: Any) -> None:
    """Reject engine options no run could use, naming the option (weights and thresholds must
    be finite, counts at least 1, ``threshold`` a probability or ``None``)."""
    require_finite(
        "SelfRAGQueryEngine",
        w_rel=engine.w_rel,
        w_sup=engine.w_sup,
        w_use=engine.w_use,
        threshold=engine.threshold,
        rewrite_threshold=engine.rewrite_threshold,
        support_threshold=engine.support_threshold,
        utility_threshold=engine.utility_threshold,
    )
    if engine.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {engine.max_new_tokens}")
    if engine.ndocs is not None and engine.ndocs < 1:
        raise ValueError(f"ndocs must be at least 1 or None, got {engine.ndocs}")
    if engine.max_retrieval_rounds < 1:
        raise ValueError("max_retrieval_rounds must be at least 1 (the first retrieval)")
    if engine.threshold is not None and not 0.0 <= engine.threshold <= 1.0:
        raise ValueError(f"threshold is a probability in [0, 1] (or None), got {engine.threshold}")


def check_retriever(retriever: Any) -> None:
    """Reject a retriever that cannot retrieve, at construction rather than at the first query."""
    if not callable(getattr(retriever, "retrieve", None)):
        raise TypeError(
            f"retriever must be a LlamaIndex retriever (with retrieve()), got "
            f"{type(retriever).__name__}: pass e.g. retriever=index.as_retriever()"
        )


def checked_nodes(nodes: Any, source: Any) -> list[NodeWithScore]:
    """``nodes`` as a list, or a ``TypeError`` naming the retriever or postprocessor that
    returned something other than a list of ``NodeWithScore``."""
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
    iterates the nodes before we see them: a ``_retrieve`` returning ``None`` fails there)."""
    try:
        yield
    except (TypeError, AttributeError) as error:
        if str(error).startswith(type(retriever).__name__):
            raise  # ours, already named
        raise TypeError(
            f"{type(retriever).__name__} failed while retrieving ({type(error).__name__}: "
            f"{error}); a retriever must return a list of NodeWithScore (an empty list when "
            "nothing matches), not None or bare nodes"
        ) from error


def retrieve(retriever: Any, postprocessors: Sequence[Any], text: str) -> Retrieved:
    """Retrieve for ``text`` and run the postprocessors, noting one that dropped every node."""
    bundle = QueryBundle(text)
    with _retriever_errors(retriever), client_lock(vector_store_of(retriever)):
        nodes = checked_nodes(retriever.retrieve(bundle), retriever)
    with collect_notes() as notes:
        kept, dropped_by = nodes, None
        for post in postprocessors:
            before = len(kept)
            kept = checked_nodes(post.postprocess_nodes(kept, query_bundle=bundle), post)
            if before and not kept and dropped_by is None:
                dropped_by = type(post).__name__
    return retrieved_nodes(nodes, kept, dropped_by, notes)


async def aretrieve(retriever: Any, postprocessors: Sequence[Any], text: str) -> Retrieved:
    """Async :func:`retrieve`."""
    bundle = QueryBundle(text)
    store = vector_store_of(retriever)
    with _retriever_errors(retriever):
        if sync_client(store) is not None:  # its async calls would fail: its sync one, in a thread
            found = await in_thread(store, retriever.retrieve, bundle)
        else:
            found = await retriever.aretrieve(bundle)
        nodes = checked_nodes(found, retriever)
    with collect_notes() as notes:
        kept, dropped_by = nodes, None
        for post in postprocessors:
            before = len(kept)
            kept = checked_nodes(await post.apostprocess_nodes(kept, query_bundle=bundle), post)
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


def ensure_support(
    candidates: list[Candidate],
    trace: list[dict[str, Any]],
    *,
    regenerate: Callable[[Candidate], Step],
    score: Callable[[ParagraphJudgement], float],
    threshold: float,
    attempts: int,
) -> Generator[Step, Any, Candidate | None]:
    """The corrective loop's last step: regenerate an unsupported best answer (``attempts``
    times, with the step ``regenerate`` builds), then fall back to the next-best answer whose
    support reaches ``threshold``, else keep the best."""
    ranked = sorted(
        (c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()),
        key=lambda c: -c.score,
    )
    if not ranked or ranked[0].judgement.support >= threshold:
        return ranked[0] if ranked else None
    best = ranked[0]
    for attempt in range(1, attempts + 1):
        (redo,) = yield regenerate(best)
        node_id = best.node.node_id
        trace.append(
            dict(step="regenerate", attempt=attempt, support=redo.support, node_id=node_id)
        )
        if redo.error is None and redo.support >= threshold and redo.answer.strip():
            best.judgement = redo
            best.score = score(redo)
            return best
    for other in ranked[1:]:
        if other.judgement.support >= threshold:
            trace.append({"step": "next_best", "node_id": other.node.node.node_id})
            return other
    trace.append({"step": "keep_best", "reason": "no paragraph supports its answer"})
    return best
