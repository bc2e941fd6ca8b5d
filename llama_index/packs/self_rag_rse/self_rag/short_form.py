"""Self-RAG's short form: one answer per retrieved paragraph, the best one wins.

After the gate said retrieve: retrieve (and post-process), let the critic answer from every
paragraph at once and score each answer, and return the best. The optional corrective loop
re-retrieves with a pseudo-document (query2doc) or a rewritten query when nothing relevant came
back or the best answer is of low utility, and regenerates an unsupported answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts, Outcome, passages
from llama_index.packs.self_rag_rse.self_rag.record import (
    Fallback,
    KeepBest,
    NextBest,
    Paragraph,
    Query2Doc,
    Regenerate,
    Repeated,
    Retrieve,
    Rewrite,
    SkipEmpty,
)

#: Why the corrective loop searches again.
NOTHING_RELEVANT = "no relevant paragraph"
LOW_UTILITY = "low utility"


@dataclass(frozen=True)
class Corrective:
    """The corrective loop's knobs (the engine's options of the same names)."""

    max_retrieval_rounds: int
    rewrite_threshold: float
    support_threshold: float
    utility_threshold: float
    max_regenerations: int


async def short_form(parts: FlowParts, query: str, corrective: Corrective | None) -> Outcome:
    """Judge the retrieved paragraphs (over the corrective loop's rounds) and pick the answer.

    Every judged paragraph goes into the query's record, whose rows are the candidates.
    """
    record = parts.record
    seen: set[str] = set()
    search_query = query
    rounds = corrective.max_retrieval_rounds if corrective is not None else 1
    for round_number in range(1, rounds + 1):
        fresh = await passages(parts, search_query, seen=seen, round=round_number)
        if fresh:
            node_ids = [n.node.node_id for n in fresh]
            with tracing.span("SelfRAG.judge", query=query, node_ids=node_ids) as span:
                judgements = await parts.critic.ajudge(query, [parts.paragraph(n) for n in fresh])
                for node, judgement in zip(fresh, judgements, strict=True):
                    seen.add(node.node.node_id)
                    record.judged(node, judgement, parts.score(judgement))
                span.result = record.paragraphs[-len(fresh) :]
        if corrective is None or round_number == rounds:
            break
        reason = _search_again(record.paragraphs, corrective)
        if reason is None:
            break
        search_query = await _new_search_text(parts, query, reason)
        # A greedy critic rewrites the question the same way every round (its prompt holds
        # only the question): a text searched already ends the rounds.
        if search_query in [step.query for step in record.steps(Retrieve)]:
            record.add(Repeated(reason="the text was searched already: the loop stops"))
            break

    candidates = record.paragraphs
    chosen = best_candidate(candidates)
    if corrective is not None:
        # Keep only paragraphs that passed the relevance bar across rounds; if none did,
        # every round failed and the model answers alone.
        relevant = _relevant(candidates, corrective)
        if candidates and not relevant:
            record.add(Fallback(reason="no relevant paragraph in any round"))
            return _outcome(parts, None)
        chosen = await _ensure_support(parts, query, relevant, corrective)
    # Both pickers take only answers with text: there is none when nothing is chosen.
    if chosen is None:
        reason = "no usable answer" if candidates else _no_nodes_reason(parts)
        record.add(Fallback(reason=reason))
    return _outcome(parts, chosen)


def _search_again(candidates: list[Paragraph], corrective: Corrective) -> str | None:
    """Why the corrective loop searches again after a round (``None``: it need not)."""
    best = best_candidate(_relevant(candidates, corrective))
    if best is None:
        return NOTHING_RELEVANT
    if best.judgement.utility < corrective.utility_threshold:
        return LOW_UTILITY
    return None


async def _new_search_text(parts: FlowParts, query: str, reason: str) -> str:
    """The next round's search text, written by the model: a pseudo-document (query2doc) the
    first time nothing relevant came back, a rewritten query after that or for low utility.
    An empty one stands for the question (searched already: the rounds end).
    """
    first_time = reason == NOTHING_RELEVANT and not parts.record.steps(Query2Doc)
    step = Query2Doc if first_time else Rewrite
    # Each kind has its prompt, "query2doc_prompt" or "rewrite_prompt", and a span of its name.
    with tracing.span(f"SelfRAG.{step.kind}", reason=reason) as span:
        written = await parts.critic.agenerate(parts.prompt(f"{step.kind}_prompt", query))
        parts.record.add(step(reason=reason, query=written))
        span.result = written
    return written if written.strip() else query


def best_candidate(candidates: list[Paragraph]) -> Paragraph | None:
    """Highest-scoring paragraph with an answer (an empty answer cannot be the response)."""
    return max(_usable(candidates), key=lambda c: c.score, default=None)


def _usable(candidates: list[Paragraph]) -> list[Paragraph]:
    """Paragraphs the critic did not fail on, whose answer has text."""
    return [c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()]


async def _ensure_support(
    parts: FlowParts, query: str, candidates: list[Paragraph], corrective: Corrective
) -> Paragraph | None:
    """The corrective loop's last step: regenerate an unsupported best answer (grounded in its
    paragraph, ``max_regenerations`` times), then fall back to the next-best answer whose
    support reaches ``support_threshold``, else keep the best.
    """
    threshold = corrective.support_threshold
    ranked = sorted(_usable(candidates), key=lambda c: -c.score)
    if not ranked:
        return None
    best = ranked[0]
    if best.judgement.support >= threshold:
        return best
    grounded = parts.prompt("grounded_prompt", query)
    previous: str | None = None
    for attempt in range(1, corrective.max_regenerations + 1):
        with tracing.span("SelfRAG.regenerate", node_id=best.node_id, attempt=attempt) as span:
            (redo,) = await parts.critic.ajudge(grounded, [parts.paragraph(best.node)])
            parts.record.add(
                Regenerate(attempt=attempt, support=redo.support, node_id=best.node_id)
            )
            span.result = redo
        if redo.error is None and redo.support >= threshold and redo.answer.strip():
            parts.record.regenerated(best, redo, parts.score(redo))
            return best
        # Each attempt has the same prompt: one that repeats the last, another would repeat.
        if redo.error is None and redo.answer == previous:
            parts.record.add(
                Repeated(
                    reason="the same answer as the attempt before: a greedy critic would "
                    "write it again"
                )
            )
            break
        previous = redo.answer
    for other in ranked[1:]:
        if other.judgement.support >= threshold:
            parts.record.add(NextBest(node_id=other.node_id))
            return other
    parts.record.add(KeepBest())
    return best


def _relevant(candidates: list[Paragraph], corrective: Corrective) -> list[Paragraph]:
    """Paragraphs the corrective loop may answer from: relevance at the bar, no error."""
    bar = corrective.rewrite_threshold
    return [c for c in candidates if c.judgement.error is None and c.judgement.relevance >= bar]


def _no_nodes_reason(parts: FlowParts) -> str:
    """Why there was nothing to judge, from the last retrieval's trace entry."""
    retrievals = parts.record.steps(Retrieve)
    if retrievals and retrievals[-1].dropped_by:
        return str(retrievals[-1].reason)
    if parts.record.steps(SkipEmpty):
        return "every retrieved paragraph was empty"
    return "retriever returned no nodes"


def _outcome(parts: FlowParts, chosen: Paragraph | None) -> Outcome:
    """The chosen answer with every judged paragraph as a source (the chosen one first, then by
    score; an empty answer can outscore the chosen one but cannot be the response).
    """
    candidates = parts.record.paragraphs
    parts.record.retrieved = bool(candidates)
    parts.record.choose(chosen)
    ranked = sorted(candidates, key=lambda c: (c is not chosen, -c.score))
    sources = [NodeWithScore(node=c.node.node, score=c.reported_score) for c in ranked]
    answer = chosen.judgement.answer if chosen is not None else None
    return Outcome(answer, sources, parts.record)
