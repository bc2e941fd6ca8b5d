"""The records the Self-RAG flow runs on, and the steps both forms share: per query the
engine builds a :class:`FlowParts` for :func:`~.short_form.short_form` or
:func:`~.long_form.long_form`, which never see the engine itself, and gets an
:class:`Outcome` back. Here too: the query checked before any work (:func:`check_query`), the
passages a form judges (:func:`passages`) and the response text (:func:`final_text`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import NodeWithScore, QueryBundle, QueryType

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.critic.checked import CheckedCritic
from llama_index.packs.self_rag_rse.critic.contract import ParagraphJudgement
from llama_index.packs.self_rag_rse.self_rag.record import (
    NoAnswer,
    QueryRecord,
    Retrieve,
    SkipEmpty,
)
from llama_index.packs.self_rag_rse.self_rag.retrieval import Retrieval, node_text

#: The response when neither any paragraph nor the model alone produced text.
NO_ANSWER = "No answer could be generated for this question."


@dataclass(frozen=True)
class FlowParts:
    """What the forms need.

    ``critic`` is the engine's critic behind its checks; ``retrieve`` runs the retriever and the
    postprocessors for a search text; ``score`` gives a judgement's final score; ``paragraph``
    the text the critic reads for a node; ``prompts`` are the engine's templates (the corrective
    loop's); ``ndocs`` is the most paragraphs judged per retrieval (``None``: all); ``record``
    is the query's record, which the forms write into.
    """

    critic: CheckedCritic
    retrieve: Callable[[str], Awaitable[Retrieval]]
    score: Callable[[ParagraphJudgement], float]
    paragraph: Callable[[NodeWithScore], str]
    prompts: Mapping[str, BasePromptTemplate]
    ndocs: int | None
    record: QueryRecord

    def prompt(self, key: str, query: str) -> str:
        """The engine's prompt ``key`` for ``query``."""
        return self.prompts[key].format(query_str=query)


@dataclass
class Outcome:
    """Where the flow ended: the answer (``None``: the model answers alone, with no evidence,
    and may stream it), the sources (best first; long form: the cited passages) and the query's
    record; long form's answer is ``pieces`` (its cited segments) joined by spaces.
    """

    answer: str | None
    sources: list[NodeWithScore]
    record: QueryRecord
    pieces: list[str] = field(default_factory=list)

    def apieces(self, critic: CheckedCritic, query: str) -> AsyncGenerator[str, None]:
        """The answer as a stream: long form's segments (they join to the answer), a known
        answer in one piece, or, when the model answers alone, the critic's answer to ``query``
        as it writes it (in a ``SelfRAG.generate`` span that ends with the stream, as the
        non-streamed answer's ends with it).
        """
        if self.answer is None:
            opened = tracing.open_span("SelfRAG.generate", query=query)
            return tracing.traced(critic.astream_answer(query), opened)
        return _known(self.pieces or [self.answer])


async def _known(pieces: list[str]) -> AsyncGenerator[str, None]:
    """A known answer's pieces as an async stream, a space before each but the first."""
    yield pieces[0]
    for piece in pieces[1:]:
        yield f" {piece}"


def query_bundle(query: QueryType) -> QueryBundle:
    """The query as a bundle (a bundle given is used whole: its embedding strings too)."""
    return query if isinstance(query, QueryBundle) else QueryBundle(query)


def final_text(answer: str, record: QueryRecord) -> str:
    """The response text: never empty (an empty answer says so, in the text and the trace).
    The critic's checks have made sure it is text.
    """
    answer = answer.strip()
    if not answer:
        record.add(NoAnswer())
        return NO_ANSWER
    return answer


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
    for position, character in enumerate(text):
        # A lone surrogate (what decoding bytes with errors="surrogateescape" leaves): no model
        # can encode it.
        if "\ud800" <= character <= "\udfff":
            raise ValueError(
                f"query has a lone surrogate at {position}: decode it with errors='replace'"
            )


async def passages(
    parts: FlowParts,
    text: str,
    *,
    seen: set[str] | None = None,
    round: int | None = None,
    depth: int | None = None,
) -> list[NodeWithScore]:
    """Retrieve for ``text`` and return the paragraphs a form judges.

    Nodes already ``seen`` (their ids) are left out; empty paragraphs are skipped (traced, and
    added to ``seen``) and never take a place, so an image node ranked first leaves room for
    the next paragraph with text; the rest is cut to ``ndocs``. The retrieval is traced with
    where it ran: the short form's ``round`` or the long form's ``depth`` (and is a span, the
    retriever's and the postprocessors' own spans inside it).
    """
    with tracing.span("SelfRAG.retrieve", query=text, round=round, depth=depth) as span:
        retrieved = await parts.retrieve(text)
        fresh = [n for n in retrieved.nodes if seen is None or n.node.node_id not in seen]
        empty = [n.node.node_id for n in fresh if not node_text(n).strip()]
        with_text = [n for n in fresh if node_text(n).strip()]
        nodes = with_text[: parts.ndocs]
        step = Retrieve(
            query=text,
            nodes=len(nodes),
            round=round,
            depth=depth,
            retrieved=retrieved.retrieved,
            dropped_by=retrieved.dropped_by,
            reason=retrieved.note,
        )
        parts.record.add(step)
        span.result = step
        if empty:
            parts.record.add(SkipEmpty(node_ids=empty))
            if seen is not None:
                seen.update(empty)
    return nodes
