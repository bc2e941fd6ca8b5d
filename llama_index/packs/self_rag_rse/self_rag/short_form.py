"""Self-RAG's short form: one answer per retrieved paragraph, the best one wins.

After the gate said retrieve: retrieve (and post-process), let the critic answer from every
paragraph at once and score each answer, and return the best. The optional corrective loop
re-retrieves with a pseudo-document (query2doc) or a rewritten query when nothing relevant came
back or the best answer is of low utility, and regenerates an unsupported answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.critic.contract import ParagraphJudgement
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts, Outcome, passages


@dataclass(frozen=True)
class Corrective:
    """The corrective loop's knobs (the engine's options of the same names)."""

    max_retrieval_rounds: int
    rewrite_threshold: float
    support_threshold: float
    utility_threshold: float
    max_regenerations: int


@dataclass
class Candidate:
    """One judged paragraph: its node, the critic's judgement and the final score."""

    node: NodeWithScore
    judgement: ParagraphJudgement
    score: float


async def short_form(
    parts: FlowParts, query: str, meta: dict[str, Any], corrective: Corrective | None
) -> Outcome:
    """Judge the retrieved paragraphs (over the corrective loop's rounds) and pick the answer."""
    trace = parts.trace
    candidates: list[Candidate] = []
    seen: set[str] = set()
    search_query = query
    rounds = corrective.max_retrieval_rounds if corrective is not None else 1
    for round_ in range(1, rounds + 1):
        fresh = await passages(parts, search_query, seen, round=round_)
        if fresh:
            judged = await parts.critic.ajudge(query, [parts.paragraph(n) for n in fresh])
            judgements = parts.checked("ajudge", judged, len(fresh))
            for node, judgement in zip(fresh, judgements, strict=True):
                seen.add(node.node.node_id)
                candidates.append(Candidate(node, judgement, parts.score(judgement)))
        if corrective is None or round_ == rounds:
            break
        best = best_candidate(_relevant(candidates, corrective))
        if best is None:
            reason = "no relevant paragraph"
        elif best.judgement.utility < corrective.utility_threshold:
            reason = "low utility"
        else:
            break
        # query2doc first when nothing relevant came back; a rewrite after that, or for utility.
        tried = any(entry["step"] == "query2doc" for entry in trace)
        step = "query2doc" if reason == "no relevant paragraph" and not tried else "rewrite"
        written = await parts.critic.agenerate(parts.prompt(f"{step}_prompt", query))
        search_query = parts.checked("agenerate", written)
        trace.append({"step": step, "reason": reason, "query": search_query})
        if not search_query.strip():
            search_query = query

    chosen = best_candidate(candidates)
    if corrective is not None:
        # Keep only paragraphs that passed the relevance bar across rounds; if none did,
        # every round failed and the model answers alone.
        relevant = _relevant(candidates, corrective)
        if candidates and not relevant:
            trace.append({"step": "fallback", "reason": "no relevant paragraph in any round"})
            return _outcome(None, candidates, meta, retrieved=True)
        chosen = await _ensure_support(parts, query, relevant, corrective)
    if chosen is None or not chosen.judgement.answer.strip():
        reason = "no usable answer" if candidates else _no_nodes_reason(trace)
        trace.append({"step": "fallback", "reason": reason})
        return _outcome(None, candidates, meta, retrieved=bool(candidates))
    return _outcome(chosen, candidates, meta, retrieved=True)


def best_candidate(candidates: list[Candidate]) -> Candidate | None:
    """Highest-scoring paragraph with an answer (an empty answer cannot be the response)."""
    return max(_usable(candidates), key=lambda c: c.score, default=None)


def _usable(candidates: list[Candidate]) -> list[Candidate]:
    return [c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()]


async def _ensure_support(
    parts: FlowParts, query: str, candidates: list[Candidate], corrective: Corrective
) -> Candidate | None:
    """The corrective loop's last step: regenerate an unsupported best answer (grounded in its
    paragraph, ``max_regenerations`` times), then fall back to the next-best answer whose
    support reaches ``support_threshold``, else keep the best.
    """
    threshold = corrective.support_threshold
    ranked = sorted(_usable(candidates), key=lambda c: -c.score)
    if not ranked or ranked[0].judgement.support >= threshold:
        return ranked[0] if ranked else None
    best = ranked[0]
    grounded = parts.prompt("grounded_prompt", query)
    for attempt in range(1, corrective.max_regenerations + 1):
        judged = await parts.critic.ajudge(grounded, [parts.paragraph(best.node)])
        (redo,) = parts.checked("ajudge", judged, 1)
        entry = dict(step="regenerate", attempt=attempt, support=redo.support)
        parts.trace.append(entry | {"node_id": best.node.node_id})
        if redo.error is None and redo.support >= threshold and redo.answer.strip():
            best.judgement = redo
            best.score = parts.score(redo)
            return best
    for other in ranked[1:]:
        if other.judgement.support >= threshold:
            parts.trace.append({"step": "next_best", "node_id": other.node.node.node_id})
            return other
    parts.trace.append({"step": "keep_best", "reason": "no paragraph supports its answer"})
    return best


def _relevant(candidates: list[Candidate], corrective: Corrective) -> list[Candidate]:
    """Paragraphs the corrective loop may answer from: relevance at the bar, no error."""
    return [
        c
        for c in candidates
        if c.judgement.error is None and c.judgement.relevance >= corrective.rewrite_threshold
    ]


def _no_nodes_reason(trace: list[dict[str, Any]]) -> str:
    """Why there was nothing to judge, from the last retrieval's trace entry."""
    last = next((e for e in reversed(trace) if e.get("step") == "retrieve"), None)
    if last is not None and last.get("dropped_by"):
        return str(last["reason"])
    if any(e.get("step") == "skip_empty" for e in trace):
        return "every retrieved paragraph was empty"
    return "retriever returned no nodes"


def _outcome(
    chosen: Candidate | None, candidates: list[Candidate], meta: dict[str, Any], retrieved: bool
) -> Outcome:
    """The chosen answer with every judged paragraph as a source (the chosen one first, then by
    score; an empty answer can outscore the chosen one but cannot be the response).
    """
    meta["retrieve"] = retrieved
    meta["paragraphs"] = [_row(c) for c in candidates]
    if chosen is not None:
        meta["best"] = next(i for i, c in enumerate(candidates) if c is chosen)
    ranked = sorted(candidates, key=lambda c: (c is not chosen, -c.score))
    sources = [
        NodeWithScore(node=c.node.node, score=c.score if c.judgement.error is None else None)
        for c in ranked
    ]
    return Outcome(chosen.judgement.answer if chosen else None, sources, meta)


def _row(c: Candidate) -> dict[str, Any]:
    """The row of ``metadata["self_rag"]["paragraphs"]`` for one candidate."""
    j = c.judgement
    row: dict[str, Any] = {"node_id": c.node.node.node_id, "answer": j.answer}
    row |= {name: getattr(j, name) for name in ("relevance", "support", "utility", "seq_score")}
    row["score"] = c.score if j.error is None else None
    if j.error is not None:
        row["error"] = j.error
    if j.details:
        row["details"] = j.details
    return row
