"""Self-RAG's short form: one answer per retrieved paragraph, the best one wins.

After the gate said retrieve: retrieve (and post-process), let the critic answer from every
paragraph at once and score each answer, and return the best. The optional corrective loop
re-retrieves with a pseudo-document (query2doc) or a rewritten query when nothing relevant came
back or the best answer is of low utility, and regenerates an unsupported answer. Written as a
generator of :class:`~.steps.Step` objects for the engine's drivers.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

from llama_index.packs.self_rag_rse.self_rag.steps import (
    Outcome,
    Retrieved,
    Step,
    best_candidate,
    ensure_support,
    no_nodes_reason,
    node_text,
)
from llama_index.packs.self_rag_rse.self_rag.trace import Candidate, paragraph_meta


def short_form_flow(engine: Any, query: str, meta: dict[str, Any]) -> Generator[Step, Any, Outcome]:
    """Judge the retrieved paragraphs (over the corrective loop's rounds) and pick the answer."""
    trace: list[dict[str, Any]] = meta["trace"]
    candidates: list[Candidate] = []
    seen: set[str] = set()
    rounds = 0
    search_query = query
    used_query2doc = False
    while True:
        rounds += 1
        retrieved: Retrieved = yield Step("retrieve", search_query)
        fresh = [n for n in retrieved.nodes if n.node.node_id not in seen]
        if engine.ndocs is not None:
            fresh = fresh[: engine.ndocs]
        entry: dict[str, Any] = dict(
            step="retrieve", round=rounds, query=search_query, nodes=len(fresh)
        )
        if retrieved.dropped_by is not None:
            entry["retrieved"] = retrieved.retrieved
            entry["dropped_by"] = retrieved.dropped_by
            entry["reason"] = retrieved.note
        trace.append(entry)
        empty = [n for n in fresh if not node_text(n).strip()]
        if empty:
            # Nothing to judge or to answer from: skip, and say so.
            ids = [n.node.node_id for n in empty]
            trace.append(dict(step="skip_empty", node_ids=ids, reason="paragraph has no text"))
            seen.update(n.node.node_id for n in empty)
            fresh = [n for n in fresh if n not in empty]
        if fresh:
            judgements = yield Step("judge", query, [engine._paragraph(n) for n in fresh])
            for node, judgement in zip(fresh, judgements, strict=True):
                seen.add(node.node.node_id)
                candidates.append(Candidate(node, judgement, engine._score(judgement)))
        if not engine.corrective or rounds >= engine.max_retrieval_rounds:
            break
        best = best_candidate(_relevant(engine, candidates))
        if best is None:
            reason = "no relevant paragraph"
        elif best.judgement.utility < engine.utility_threshold:
            reason = "low utility"
        else:
            break
        if not used_query2doc and reason == "no relevant paragraph":
            used_query2doc = True
            search_query = yield Step("generate", engine._prompt("query2doc_prompt", query))
            trace.append({"step": "query2doc", "reason": reason, "query": search_query})
        else:
            search_query = yield Step("generate", engine._prompt("rewrite_prompt", query))
            trace.append({"step": "rewrite", "reason": reason, "query": search_query})
        if not search_query.strip():
            search_query = query

    if engine.corrective:
        # Keep only paragraphs that passed the relevance bar across rounds; if none did,
        # every round failed and the model answers alone.
        relevant = _relevant(engine, candidates)
        if candidates and not relevant:
            trace.append({"step": "fallback", "reason": "no relevant paragraph in any round"})
            meta["retrieve"] = True
            meta["paragraphs"] = [paragraph_meta(c) for c in candidates]
            return Outcome(None, candidates, meta)
        grounded = engine._prompt("grounded_prompt", query)
        chosen = yield from ensure_support(
            relevant,
            trace,
            regenerate=lambda c: Step("judge", grounded, [engine._paragraph(c.node)]),
            score=engine._score,
            threshold=engine.support_threshold,
            attempts=engine.max_regenerations,
        )
    else:
        chosen = best_candidate(candidates)

    meta["retrieve"] = bool(candidates)
    meta["paragraphs"] = [paragraph_meta(c) for c in candidates]
    if chosen is None or not chosen.judgement.answer.strip():
        reason = "no usable answer" if candidates else no_nodes_reason(trace)
        trace.append({"step": "fallback", "reason": reason})
        return Outcome(None, candidates, meta)
    return Outcome(chosen.judgement.answer, candidates, meta, chosen)


def _relevant(engine: Any, candidates: list[Candidate]) -> list[Candidate]:
    """Paragraphs the corrective loop may answer from: relevance at the bar, no error."""
    return [
        c
        for c in candidates
        if c.judgement.error is None and c.judgement.relevance >= engine.rewrite_threshold
    ]
