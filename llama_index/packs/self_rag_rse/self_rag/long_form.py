"""Self-RAG's long form: an answer written segment by segment, each segment citing its passage.

Paper §3.3 and the official ``run_long_form_static.py``, with their defects fixed (see the
README's table of differences). A beam of paths starts at the prompt. At each depth every
unfinished path is continued once per passage, all continuations of the depth in one batched
call of the critic (:meth:`~.contract.BaseCritic.awrite_segments`); a continuation stops at the
model's next ``[Retrieval]`` (a boundary: the path goes on) or at the end of generation or the
token limit (the path is finished). Each segment is scored like a short-form answer; a path's
score is the mean of its segments'; the ``beam_width`` best candidates (stable order on ties)
form the next beam. The answer is the best path: its segments' texts, each followed by the
1-based number of its passage among the response's sources.

Passages: ``segment_retrieval="once"`` uses the query's passages at every depth;
``"per_segment"`` retrieves again for each path at depth > 1 with ``query + " " + its last
segment's text``. Both go through the engine's retriever, ``node_postprocessors`` and ``ndocs``.

Written as a generator of :class:`~.steps.Step` objects, like the short form, so that ``query``
and ``aquery`` share it; with ``beam_width=1`` it also yields an ``"emit"`` step per decided
segment, which a streamed response passes on as soon as it comes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Generator
from dataclasses import dataclass, field
from typing import Any

from llama_index.core.schema import NodeWithScore

from llama_index.packs.self_rag_rse.self_rag.contract import Continuation
from llama_index.packs.self_rag_rse.self_rag.steps import Outcome, Retrieved, Step, node_text


def long_form_unsupported(critic: str) -> str:
    """Why the ``critic`` cannot write long-form answers, and what to use instead."""
    return (
        f"long_form=True needs a Self-RAG model (one with reflection tokens, read by the "
        f"reflection critic in process or served), but the {critic} critic judges with prompts: "
        "use the short form (long_form=False), or the corrective loop (corrective=True) for "
        "questions that need several passages"
    )


def check_long_form(engine: Any) -> None:
    """Reject long-form options no run could use, naming the option."""
    if engine.beam_width < 1:
        raise ValueError(f"beam_width must be at least 1, got {engine.beam_width}")
    if engine.max_segments < 1:
        raise ValueError(f"max_segments must be at least 1, got {engine.max_segments}")
    if engine.long_form and engine.corrective:
        raise ValueError(
            "long_form=True and corrective=True cannot be combined: the corrective loop "
            "re-retrieves and regenerates short-form answers; long form retrieves per segment "
            "(segment_retrieval='per_segment')"
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
        if not self.segments:
            return 0.0
        return sum(s.score for s in self.segments) / len(self.segments)

    def child(self, written: Written) -> Path:
        """This path continued by ``written``; finished unless it stopped at a boundary."""
        return Path(
            written.segment.context,
            [*self.segments, written],
            finished=written.segment.stop != "boundary",
        )


def long_form_flow(engine: Any, query: str, meta: dict[str, Any]) -> Generator[Step, Any, Outcome]:
    """The beam search for ``query`` (after the gate said retrieve), as steps for the engine's
    drivers; returns the best path as the :class:`~.steps.Outcome`."""
    trace: list[dict[str, Any]] = meta["trace"]
    meta["retrieve"] = True
    emit = engine.streaming and engine.beam_width == 1
    start = yield Step("start", query)
    first = yield from _passages(engine, query, trace, 1)
    beam = [Path(tuple(start))]
    numbers: dict[str, int] = {}  # citation numbers of the emitted segments
    emitted = 0
    while meta["depth"] < engine.max_segments and any(not p.finished for p in beam):
        depth = meta["depth"] = meta["depth"] + 1
        passages: dict[int, list[NodeWithScore]] = {}
        for i, path in enumerate(beam):
            if path.finished:
                continue
            if depth == 1 or engine.segment_retrieval == "once":
                passages[i] = first
            else:
                text = f"{query} {path.segments[-1].segment.answer}"
                passages[i] = yield from _passages(engine, text, trace, depth)
        branches = [
            (beam[i].context, engine._paragraph(node))
            for i, nodes in passages.items()
            for node in nodes
        ]
        segments = iter((yield Step("write", query, branches=branches)) if branches else [])
        candidates: list[Path] = []
        for i, path in enumerate(beam):
            if path.finished:
                candidates.append(path)
                continue
            children = []
            for node in passages[i]:
                segment = next(segments)
                if segment.error is not None:
                    trace.append(
                        dict(step="segment_failed", depth=depth, path=i, node_id=_id(node))
                        | {"error": segment.error}
                    )
                    continue
                children.append(path.child(Written(segment, node, engine._score(segment))))
            if not children:
                why = "no passages" if not passages[i] else "every continuation failed"
                trace.append(dict(step="path_finished", depth=depth, path=i, reason=why))
                candidates.append(Path(path.context, path.segments, finished=True))
            candidates.extend(children)
        candidates.sort(key=lambda p: p.score, reverse=True)  # stable: ties keep their order
        beam = candidates[: engine.beam_width]
        kept = {id(p) for p in beam}
        trace.append({"step": "depth", "depth": depth, "candidates": _depth_rows(candidates, kept)})
        meta["beams"].append(
            [{"score": p.score, "node_ids": [_id(w.passage) for w in p.segments]} for p in beam]
        )
        if emit:  # one path: its new segments are final
            for new in beam[0].segments[emitted:]:
                if new.segment.answer:
                    yield Step("emit", (" " if numbers else "") + _cite(new, numbers))
            emitted = len(beam[0].segments)
    return _answer(beam[0], meta, trace)


async def astream_pieces(
    engine: Any, query: str, meta: dict[str, Any], sources: list[NodeWithScore]
) -> AsyncIterator[str]:
    """A long-form answer's pieces as the flow runs: each ``"emit"`` step's text
    (``beam_width=1``), else the whole answer at the end, or the model's own answer streamed
    when nothing was retrieved; ``sources`` and ``meta`` fill in meanwhile. ``query`` reads
    it through :func:`~..common.bridge.iterate_sync`."""
    flow = engine._flow(query, meta)
    emitted = False
    try:
        step = next(flow)
        while True:
            if step.kind == "emit":
                emitted = True
                yield step.text
            step = flow.send(None if step.kind == "emit" else await engine._arun(step))
    except StopIteration as done:
        outcome: Outcome = done.value
    sources.extend(engine._parts(outcome)["source_nodes"])
    if outcome.answer is None:
        async for piece in engine._critic.astream_generate(query):
            yield piece
    elif not emitted:
        yield outcome.answer


def _passages(
    engine: Any, text: str, trace: list[dict[str, Any]], depth: int
) -> Generator[Step, Any, list[NodeWithScore]]:
    """Retrieve (retriever, then the engine's postprocessors), cut to ``ndocs``, skip empty ones."""
    retrieved: Retrieved = yield Step("retrieve", text)
    nodes = retrieved.nodes[: engine.ndocs] if engine.ndocs is not None else retrieved.nodes
    entry: dict[str, Any] = dict(step="retrieve", depth=depth, query=text, nodes=len(nodes))
    if retrieved.dropped_by is not None:
        entry.update(retrieved=retrieved.retrieved, dropped_by=retrieved.dropped_by)
        entry["reason"] = retrieved.note
    trace.append(entry)
    empty = [_id(n) for n in nodes if not node_text(n).strip()]
    if empty:
        trace.append(dict(step="skip_empty", node_ids=empty, reason="paragraph has no text"))
    return [n for n in nodes if node_text(n).strip()]


def _cite(written: Written, numbers: dict[str, int]) -> str:
    """``"text [n]"``, numbering the passage on its first citation."""
    n = numbers.setdefault(_id(written.passage), len(numbers) + 1)
    return f"{written.segment.answer} [{n}]"


def _answer(best: Path, meta: dict[str, Any], trace: list[dict[str, Any]]) -> Outcome:
    """The best path as the response: text with citations, cited passages, segment rows."""
    numbers: dict[str, int] = {}
    sources: list[NodeWithScore] = []
    parts: list[str] = []
    for written in best.segments:
        segment = written.segment
        row = {
            "text": segment.answer,
            "node_id": _id(written.passage),
            "citation": None,
            "relevance": segment.relevance,
            "support": segment.support,
            "utility": segment.utility,
            "seq_score": segment.seq_score,
            "score": written.score,
        }
        if segment.answer:
            new = _id(written.passage) not in numbers
            parts.append(_cite(written, numbers))
            row["citation"] = numbers[_id(written.passage)]
            if new:
                sources.append(NodeWithScore(node=written.passage.node, score=written.score))
        meta["segments"].append(row)
    meta["path_score"] = best.score if best.segments else None
    if not parts:
        reason = "no segment has text" if best.segments else "no passages"
        trace.append({"step": "fallback", "reason": reason})
        return Outcome(None, [], meta, sources=sources)
    return Outcome(" ".join(parts), [], meta, sources=sources)


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
