"""The records the Self-RAG flow runs on, and the passages both forms judge: per query the
engine builds a :class:`FlowParts` for :func:`~.short_form.short_form` or
:func:`~.long_form.long_form`, which never see the engine itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import NodeWithScore, QueryBundle

from llama_index.packs.self_rag_rse.critic.contract import BaseCritic, ParagraphJudgement, astream
from llama_index.packs.self_rag_rse.self_rag.retrieval import Retrieval, node_text


@dataclass(frozen=True)
class FlowParts:
    """What the forms need: ``retrieve`` (the retriever and the postprocessors, for a search
    text), the critic, ``score`` (a judgement's final score), ``paragraph`` (the text the critic
    reads for a node), the engine's prompts, ``ndocs`` and the query's trace.
    """

    critic: BaseCritic
    retrieve: Callable[[str], Awaitable[Retrieval]]
    score: Callable[[ParagraphJudgement], float]
    paragraph: Callable[[NodeWithScore], str]
    prompts: Mapping[str, BasePromptTemplate]
    ndocs: int | None
    trace: list[dict[str, Any]]

    def prompt(self, key: str, query: str) -> str:
        """The engine's prompt ``key`` for ``query``."""
        return self.prompts[key].format(query_str=query)

    def checked(self, method: str, out: Any, count: int | None = None) -> Any:
        """What the critic's ``method`` returned, when it keeps the contract (``count``
        judgements, each with text as its answer; ``None``: text), else a ``TypeError``.
        """
        if count is None:
            kept, what = isinstance(out, str), "text"
        else:
            kept = isinstance(out, list | tuple) and len(out) == count
            kept = kept and all(isinstance(getattr(j, "answer", None), str) for j in out)
            what = f"one ParagraphJudgement per paragraph ({count}), in order, with text answers"
        if not kept:
            critic = type(self.critic).__name__
            raise TypeError(f"{critic}.{method} must return {what}; it returned {out!r:.80}")
        return out


@dataclass
class Outcome:
    """Where the flow ended: the answer (``None``: the model answers alone, with no evidence,
    and may stream it), the sources (best first; long form: the cited passages) and the
    metadata; long form's answer is ``pieces`` (its cited segments) joined by spaces.
    """

    answer: str | None
    sources: list[NodeWithScore]
    meta: dict[str, Any]
    pieces: list[str] = field(default_factory=list)

    def stream(self) -> list[str] | None:
        """The known answer's stream: one piece, or long form's segments (they join to the
        answer); ``None`` when the model answers alone and streams as it writes.
        """
        if self.answer is None:
            return None
        first, *rest = self.pieces or [self.answer]
        return [first, *(f" {piece}" for piece in rest)]

    async def apieces(self, critic: BaseCritic, query: str) -> AsyncIterator[str]:
        """The known answer's stream, or the critic's own answer to ``query`` as it writes it."""
        pieces = self.stream()
        if pieces is None:
            async for piece in astream(critic, query):
                yield piece
        for piece in pieces or []:
            yield piece


def query_meta(critic: str, long_form: bool) -> dict[str, Any]:
    """A query's ``metadata["self_rag"]`` before the flow fills it in."""
    meta: dict[str, Any] = {"critic": critic, "retrieve": False, "retrieve_prob": None}
    meta |= {"best": None, "paragraphs": [], "trace": []}
    if long_form:
        meta |= {"long_form": True, "segments": [], "path_score": None, "depth": 0, "beams": []}
    return meta


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
    if (at := next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), -1)) >= 0:
        raise ValueError(f"query has a lone surrogate at {at}: decode it with errors='replace'")


async def passages(
    parts: FlowParts, text: str, seen: set[str] | None = None, **where: int
) -> list[NodeWithScore]:
    """Retrieve for ``text``, leave out nodes already ``seen`` (their ids), trace the retrieval
    (``where`` says which round or depth), skip empty paragraphs (traced, and added to
    ``seen``) and cut to ``ndocs``: the paragraphs a form judges (empty ones never take a
    place: an image node ranked first leaves room for the next paragraph with text).
    """
    retrieved = await parts.retrieve(text)
    nodes = [n for n in retrieved.nodes if seen is None or n.node.node_id not in seen]
    empty = [n.node.node_id for n in nodes if not node_text(n).strip()]
    nodes = [n for n in nodes if node_text(n).strip()][: parts.ndocs]
    entry: dict[str, Any] = dict(step="retrieve", **where, query=text, nodes=len(nodes))
    if retrieved.dropped_by is not None:
        entry.update(retrieved=retrieved.retrieved, dropped_by=retrieved.dropped_by)
        entry["reason"] = retrieved.note
    parts.trace.append(entry)
    if empty:
        parts.trace.append(dict(step="skip_empty", node_ids=empty, reason="paragraph has no text"))
        if seen is not None:
            seen.update(empty)
    return nodes
