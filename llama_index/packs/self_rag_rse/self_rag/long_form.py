"""Self-RAG's long form: an answer written segment by segment, each segment citing its passage.

Paper §3.3 and the official ``run_long_form_static.py``, with their defects fixed (see the
differences table in docs/self-rag.md). A beam of paths starts at the prompt. At each depth every
unfinished path is continued once per passage, all continuations of the depth in one batched
call of the critic (:meth:`~.contract.BaseCritic.awrite_segments`); a continuation stops at the
model's next ``[Retrieval]`` (a boundary: the path goes on) or at the end of generation or the
token limit (the path is finished). Each segment is scored like a short-form answer; a path's
score is the mean of its segments'; the ``beam_width`` best candidates (stable order on ties)
form the next beam. The answer is the best path: its segments' texts, each followed by the
1-based number of its passage among the response's sources.

Passages (:func:`~.flow.passages`): ``per_segment=False`` uses the query's at every depth;
``per_segment=True`` retrieves again for each path at depth > 1 with its last segment appended.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.critic.contract import Continuation
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts, Outcome, passages

#: A segment's scores, as its row names them.
_SCORES = ("relevance", "support", "utility", "seq_score")


def long_form_unsupported(critic: str) -> str:
    """Why the ``critic`` cannot write long-form answers, and what to use instead."""
    return (
        f"long_form=True needs a Self-RAG model (one with reflection tokens, read by the "
        f"reflection critic in process or served), but the {critic} critic judges with prompts: "
        "use the short form (long_form=False), or the corrective loop (corrective=True) for "
        "questions that need several passages"
    )


@dataclass
class Written:
    """One segment of a path: what the critic wrote, from which passage, with which score."""

    segment: Continuation
    passage: NodeWithScore
    score: float


@dataclass
class Path:
    """A partial answer: its context (what the model continues from) and its segments."""

    context: tuple[Any, ...]
    segments: list[Written] = field(default_factory=list)
    finished: bool = False

    @property
    def score(self) -> float:
        """The mean of the segments' scores (0.0 before the first segment)."""
        return sum(s.score for s in self.segments) / len(self.segments) if self.segments else 0.0

    def child(self, written: Written) -> Path:
        """This path continued by ``written``; finished unless it stopped at a boundary."""
        return Path(
            written.segment.context,
            [*self.segments, written],
            finished=written.segment.stop != "boundary",
        )


async def long_form(
    parts: FlowParts,
    query: str,
    meta: dict[str, Any],
    *,
    beam_width: int,
    max_segments: int,
    per_segment: bool,
    boundary_threshold: float | None,
) -> Outcome:
    """The beam search for ``query`` (after the gate said retrieve); returns the best path.
    ``boundary_threshold``: where a generated ``[No Retrieval]`` ends a segment (see
    :meth:`~.contract.BaseCritic.awrite_segments`).
    """
    trace = parts.trace
    meta["retrieve"] = True
    start = await parts.critic.astart_path(query)
    first = await passages(parts, query, depth=1)
    beam = [Path(tuple(start))]
    while meta["depth"] < max_segments and any(not p.finished for p in beam):
        depth = meta["depth"] = meta["depth"] + 1
        found: dict[int, list[NodeWithScore]] = {}
        for i, path in enumerate(beam):
            if path.finished:
                continue
            if depth == 1 or not per_segment:
                found[i] = first
            else:
                text = f"{query} {path.segments[-1].segment.answer}"
                found[i] = await passages(parts, text, depth=depth)
        branches = [
            (beam[i].context, parts.paragraph(node)) for i, nodes in found.items() for node in nodes
        ]
        written = (
            await parts.critic.awrite_segments(branches, boundary_threshold) if branches else []
        )
        segments = iter(parts.checked("awrite_segments", written, len(branches)))
        candidates: list[Path] = []
        for i, path in enumerate(beam):
            if path.finished:
                candidates.append(path)
                continue
            children = []
            for node in found[i]:
                segment = next(segments)
                if segment.error is not None:
                    trace.append(
                        dict(step="segment_failed", depth=depth, path=i, node_id=_id(node))
                        | {"error": segment.error}
                    )
                    continue
                children.append(path.child(Written(segment, node, parts.score(segment))))
            if not children:
                why = "no passages" if not found[i] else "every continuation failed"
                trace.append(dict(step="path_finished", depth=depth, path=i, reason=why))
                candidates.append(Path(path.context, path.segments, finished=True))
            candidates.extend(children)
        candidates.sort(key=lambda p: p.score, reverse=True)  # stable: ties keep their order
        beam = candidates[:beam_width]
        kept = {id(p) for p in beam}
        trace.append({"step": "depth", "depth": depth, "candidates": _depth_rows(candidates, kept)})
        meta["beams"].append(
            [{"score": p.score, "node_ids": [_id(w.passage) for w in p.segments]} for p in beam]
        )
    return _answer(beam[0], meta, trace)


def _answer(best: Path, meta: dict[str, Any], trace: list[dict[str, Any]]) -> Outcome:
    """The best path as the response: text with citations, cited passages, segment rows."""
    numbers: dict[str, int] = {}
    sources: list[NodeWithScore] = []
    parts: list[str] = []
    for written in best.segments:
        segment = written.segment
        row: dict[str, Any] = {"text": segment.answer, "node_id": _id(written.passage)}
        row["citation"] = None
        row |= {name: getattr(segment, name) for name in _SCORES} | {"score": written.score}
        # Tokens of the passage the critic left out to fit its n_ctx (0: read whole).
        row["passage_cut"] = int(segment.details.get("passage_cut", 0))
        if segment.answer:
            new = _id(written.passage) not in numbers
            n = row["citation"] = numbers.setdefault(_id(written.passage), len(numbers) + 1)
            parts.append(f"{segment.answer} [{n}]")  # a passage's number is its first citation's
            if new:
                sources.append(NodeWithScore(node=written.passage.node, score=written.score))
        meta["segments"].append(row)
    meta["path_score"] = best.score if best.segments else None
    if not parts:
        reason = "no segment has text" if best.segments else "no passages"
        trace.append({"step": "fallback", "reason": reason})
        return Outcome(None, sources, meta)
    return Outcome(" ".join(parts), sources, meta, parts)


def _depth_rows(candidates: list[Path], kept: set[int]) -> list[dict[str, Any]]:
    """One row per candidate of a depth (new or carried over), best first."""
    rows = []
    for rank, path in enumerate(candidates):
        last = path.segments[-1] if path.segments else None
        rows.append(
            {
                "rank": rank,
                "kept": id(path) in kept,
                "finished": path.finished,
                "path_score": path.score,
                "node_ids": [_id(w.passage) for w in path.segments],
                "segment": last.segment.answer if last else "",
                "relevance": last.segment.relevance if last else None,
                "support": last.segment.support if last else None,
                "utility": last.segment.utility if last else None,
                "score": last.score if last else None,
            }
        )
    return rows


def _id(node: NodeWithScore) -> str:
    return node.node.node_id
