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

from dataclasses import dataclass, field, replace
from typing import Any

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.critic.contract import Continuation
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts, Outcome, passages
from llama_index.packs.self_rag_rse.self_rag.record import (
    Depth,
    DepthRow,
    Fallback,
    PathFinished,
    Segment,
    SegmentFailed,
)


def long_form_unsupported(critic: str) -> str:
    """Why the ``critic`` cannot write long-form answers, and what to use instead."""
    return (
        f"long_form=True needs a Self-RAG model (one with reflection tokens, read by the "
        f"reflection critic in process or served), but the {critic} critic judges with prompts: "
        "use the short form (long_form=False), or the corrective loop (corrective=True) for "
        "questions that need several passages"
    )


@dataclass
class Path:
    """A partial answer: its context (what the model continues from) and its segments."""

    context: tuple[Any, ...]
    segments: list[Segment] = field(default_factory=list)
    finished: bool = False

    @property
    def score(self) -> float:
        """The mean of the segments' scores (0.0 before the first segment)."""
        return sum(s.score for s in self.segments) / len(self.segments) if self.segments else 0.0

    def child(self, segment: Segment) -> Path:
        """This path continued by ``segment``; finished unless it stopped at a boundary."""
        return Path(
            context=segment.written.context,
            segments=[*self.segments, segment],
            finished=segment.written.stop != "boundary",
        )


async def long_form(
    parts: FlowParts,
    query: str,
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
    record = parts.record
    record.retrieved = True
    start = await parts.critic.astart_path(query)
    first = await passages(parts, query, depth=1)
    beam = [Path(tuple(start))]
    depth = 0
    while depth < max_segments and any(not path.finished for path in beam):
        depth += 1
        with tracing.span("SelfRAG.depth", depth=depth, paths=len(beam)) as span:
            # Each unfinished path's passages, and what the critic continues: (context, paragraph).
            found: dict[int, list[NodeWithScore]] = {}
            branches: list[tuple[tuple[Any, ...], str]] = []
            for i, path in enumerate(beam):
                if path.finished:
                    continue
                nodes = first
                if depth > 1 and per_segment:
                    text = f"{query} {path.segments[-1].written.answer}"
                    nodes = await passages(parts, text, depth=depth)
                found[i] = nodes
                branches.extend((path.context, parts.paragraph(node)) for node in nodes)
            written: list[Continuation] = []
            if branches:
                written = await parts.critic.awrite_segments(branches, boundary_threshold)
            continuations = iter(written)
            candidates: list[Path] = []
            for i, path in enumerate(beam):
                if path.finished:
                    candidates.append(path)
                    continue
                children = []
                for node in found[i]:
                    continuation = next(continuations)
                    if continuation.error is not None:
                        record.add(
                            SegmentFailed(
                                depth=depth,
                                path=i,
                                node_id=node.node.node_id,
                                error=continuation.error,
                            )
                        )
                        continue
                    segment = Segment(
                        written=continuation, passage=node, score=parts.score(continuation)
                    )
                    children.append(path.child(segment))
                if not children:
                    why = "every continuation failed" if found[i] else "no passages"
                    record.add(PathFinished(depth=depth, path=i, reason=why))
                    candidates.append(Path(path.context, path.segments, finished=True))
                candidates.extend(children)
            candidates.sort(key=lambda p: p.score, reverse=True)  # stable: ties keep their order
            beam = candidates[:beam_width]
            step = Depth(depth=depth, candidates=_depth_rows(candidates, kept=beam))
            record.add(step)
            span.result = step
    return _answer(parts, beam[0])


def _answer(parts: FlowParts, best: Path) -> Outcome:
    """The best path as the response: text with citations, cited passages, segment rows."""
    record = parts.record
    numbers: dict[str, int] = {}
    sources: list[NodeWithScore] = []
    pieces: list[str] = []
    for segment in best.segments:
        text = segment.written.answer
        citation = None
        if text:
            # A passage's number is that of its first citation.
            if segment.node_id not in numbers:
                numbers[segment.node_id] = len(numbers) + 1
                sources.append(NodeWithScore(node=segment.passage.node, score=segment.score))
            citation = numbers[segment.node_id]
            pieces.append(f"{text} [{citation}]")
        record.cite(replace(segment, citation=citation))
    if not pieces:
        reason = "no segment has text" if best.segments else "no passages"
        record.add(Fallback(reason=reason))
        return Outcome(None, sources, record)
    return Outcome(answer=" ".join(pieces), sources=sources, record=record, pieces=pieces)


def _depth_rows(candidates: list[Path], kept: list[Path]) -> list[DepthRow]:
    """One row per candidate of a depth (new or carried over), best first; a path with no
    segment yet has no last segment to show.
    """
    rows = []
    for rank, path in enumerate(candidates):
        last: dict[str, Any] = {}
        if path.segments:
            segment = path.segments[-1]
            last = {
                "segment": segment.written.answer,
                "relevance": segment.written.relevance,
                "support": segment.written.support,
                "utility": segment.written.utility,
                "score": segment.score,
            }
        row = DepthRow(
            rank=rank,
            kept=any(path is kept_path for kept_path in kept),
            finished=path.finished,
            path_score=path.score,
            node_ids=[each.node_id for each in path.segments],
            **last,
        )
        rows.append(row)
    return rows
