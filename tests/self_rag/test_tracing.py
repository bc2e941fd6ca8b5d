"""A Self-RAG query in LlamaIndex instrumentation: the span tree, the events (the same facts as
``metadata["self_rag"]``) and the critic's model calls with their token counts, on the tiny
Self-RAG GGUFs; then the same through OpenInference into OpenTelemetry's in-memory exporter.
"""

from __future__ import annotations

import asyncio
import re
from collections import Counter
from typing import Any

import pytest
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from retrievers import FixedRetriever
from scripted import ScriptedLLM
from traces import name_of, openinference, otel_tree, recorded

from llama_index.packs.self_rag_rse import (
    AnswerChosenEvent,
    ParagraphJudgedEvent,
    PromptedCritic,
    SegmentCitedEvent,
    SelfRAGQueryEngine,
    SelfRAGStepEvent,
)
from llama_index.packs.self_rag_rse.common import tracing

QUESTION = "What does the while statement do?"

SHORT_FORM = [
    "SelfRAGQueryEngine.query",
    "  SelfRAG.gate",
    "    ReflectionCritic.adecide_retrieval",
    "      BatchedDecoder.complete",
    "  SelfRAG.retrieve",
    "    FixedRetriever.retrieve",
    "      FixedRetriever._retrieve",
    "  SelfRAG.judge",
    "    ReflectionCritic.ajudge",
    "      BatchedDecoder.complete",
    "      BatchedDecoder.complete",
    "      BatchedDecoder.complete",
]


def gated(make_engine: Any, **options: Any) -> Any:
    """An engine whose gate runs and always says retrieve."""
    return make_engine(mode="adaptive_retrieval", threshold=0.0, **options)


def synchronous(tree: list[str]) -> list[str]:
    """An async query's tree with the sync names (``aquery`` -> ``query``)."""
    return [line.replace(".aquery", ".query").replace(".aretrieve", ".retrieve") for line in tree]


def usage(events: list[Any]) -> tuple[int, int]:
    """Prompt and completion tokens summed over the LLM end events."""
    ends = [e for e in events if isinstance(e, LLMCompletionEndEvent)]
    prompt = sum(e.response.raw["usage"]["prompt_tokens"] for e in ends)
    completion = sum(e.response.raw["usage"]["completion_tokens"] for e in ends)
    return prompt, completion


def test_a_short_form_query_is_a_tree_of_its_steps(make_engine: Any) -> None:
    engine = gated(make_engine)
    with recorded() as record:
        response = engine.query(QUESTION)
    assert record.tree() == SHORT_FORM
    meta = response.metadata["self_rag"]
    # The events are the metadata's facts, each under the span of its step.
    steps = record.of(SelfRAGStepEvent)
    assert [event.step.as_dict() for event in steps] == meta["trace"]
    assert [(e.step.kind, record.span_of(e)) for e in steps] == [
        ("decide", "SelfRAG.gate"),
        ("retrieve", "SelfRAG.retrieve"),
    ]
    assert steps[0].step.retrieve is True
    assert steps[0].step.probability == meta["retrieve_prob"]
    judged = record.of(ParagraphJudgedEvent)
    rows = meta["paragraphs"]
    assert [(e.node_id, e.judgement.answer, e.score) for e in judged] == [
        (row["node_id"], row["answer"], row["score"]) for row in rows
    ]
    for event, row in zip(judged, rows, strict=True):
        judgement = event.judgement
        assert (judgement.relevance, judgement.support, judgement.utility) == (
            row["relevance"],
            row["support"],
            row["utility"],
        )
        assert record.span_of(event) == "SelfRAG.judge"
    (chosen,) = record.of(AnswerChosenEvent)
    assert chosen.node_id == rows[meta["best"]]["node_id"]
    assert chosen.score == rows[meta["best"]]["score"]


def test_each_model_call_carries_its_prompt_completion_and_tokens(make_engine: Any) -> None:
    engine = gated(make_engine)
    stats = engine.critic.decoder.stats
    stats.reset()
    with recorded() as record:
        engine.query(QUESTION)
    starts = record.of(LLMCompletionStartEvent)
    ends = record.of(LLMCompletionEndEvent)
    assert len(starts) == len(ends) == 4  # the gate, then one sequence per paragraph
    assert [e.span_id for e in starts] == [e.span_id for e in ends]
    assert len({e.span_id for e in starts}) == 4  # one span per call
    # The tokens each call evaluated and generated add up to what the decoder counted.
    assert usage(record.events) == (stats.prompt_tokens, stats.generated_tokens)
    for start, end in zip(starts, ends, strict=True):
        assert QUESTION in start.prompt
        assert start.model_dict["class_name"] in tracing.CRITIC_MODELS
        counts = end.response.raw["usage"]
        assert counts["total_tokens"] == counts["prompt_tokens"] + counts["completion_tokens"]
    # The judgements' prompts hold their paragraphs; completions show Self-RAG's tokens.
    assert all("<paragraph>" in start.prompt for start in starts[1:])
    assert any("[" in end.response.text for end in ends)


def test_async_and_streamed_queries_give_the_same_tree(make_engine: Any) -> None:
    with recorded() as record:
        asyncio.run(gated(make_engine).aquery(QUESTION))
    assert synchronous(record.tree()) == SHORT_FORM
    with recorded() as record:
        pieces = list(gated(make_engine, streaming=True).query(QUESTION).response_gen)
    assert pieces and record.tree() == SHORT_FORM

    async def streamed() -> list[str]:
        response = await gated(make_engine, streaming=True).aquery(QUESTION)
        return [piece async for piece in response.async_response_gen()]

    with recorded() as record:
        pieces = asyncio.run(streamed())
    assert pieces and synchronous(record.tree()) == SHORT_FORM


def test_a_streamed_query_span_ends_with_its_stream(talkative_llm: Any, make_engine: Any) -> None:
    engine = make_engine(llm=talkative_llm, mode="no_retrieval", streaming=True)
    with recorded() as record:
        response = engine.query(QUESTION)
        assert record.named("SelfRAGQueryEngine.query") == []
        text = "".join(response.response_gen)
    (query,) = record.named("SelfRAGQueryEngine.query")
    (generate,) = record.named("SelfRAG.generate")
    (call,) = record.named("BatchedDecoder.complete")
    # The model answers alone: a step of its own, the model call inside, both ended by then.
    assert record.tree() == [
        "SelfRAGQueryEngine.query",
        "  SelfRAG.generate",
        "    BatchedDecoder.complete",
    ]
    assert call.end_time <= generate.end_time <= query.end_time
    (end,) = record.of(LLMCompletionEndEvent)
    # The completion as the model wrote it: the answer streamed, among Self-RAG's tokens.
    shown = re.sub(r"\[[^]]*\]|</s>", "", end.response.text)
    assert text and "".join(text.split()) == "".join(shown.split())
    assert end.response.raw["usage"]["completion_tokens"] > 0
    # Closed before its end: the span ends then.
    with recorded() as record:
        stream = engine.query(QUESTION).response_gen
        next(stream)
        stream.close()
    assert len(record.named("SelfRAGQueryEngine.query")) == 1
    assert len(record.named("SelfRAG.generate")) == 1

    async def closed_early() -> None:
        response = await engine.aquery(QUESTION)
        stream = response.async_response_gen()
        await anext(stream)
        await stream.aclose()

    with recorded() as record:
        asyncio.run(closed_early())
    assert len(record.named("SelfRAGQueryEngine.aquery")) == 1
    assert len(record.named("SelfRAG.generate")) == 1
    assert record.spans.dropped_spans == []


def test_the_corrective_loop_shows_its_new_searches(make_engine: Any, talkative_llm: Any) -> None:
    # No paragraph reaches relevance 1: a query2doc round, a rewrite round, then the fallback
    # (the talkative model writes search texts with some text in them).
    engine = gated(
        make_engine,
        llm=talkative_llm,
        corrective=True,
        rewrite_threshold=1.0,
        max_retrieval_rounds=3,
    )
    with recorded() as record:
        meta = engine.query(QUESTION).metadata["self_rag"]
    names = Counter(name_of(span.id_) for span in record.done())
    assert names["SelfRAG.retrieve"] == 3
    assert names["SelfRAG.query2doc"] == names["SelfRAG.rewrite"] == 1
    tree = record.tree()
    for step in ("SelfRAG.query2doc", "SelfRAG.rewrite"):
        at = tree.index(f"  {step}")
        assert tree[at + 1 : at + 3] == [
            "    ReflectionCritic.agenerate",
            "      BatchedDecoder.complete",
        ]
    (query2doc,) = record.named("SelfRAG.query2doc")
    assert query2doc.parent_id == record.named("SelfRAGQueryEngine.query")[0].id_
    steps = record.of(SelfRAGStepEvent)
    assert [e.step.as_dict() for e in steps] == meta["trace"]
    searches = [(e.step.kind, record.span_of(e)) for e in steps if e.step.kind != "retrieve"]
    assert searches == [
        ("decide", "SelfRAG.gate"),
        ("query2doc", "SelfRAG.query2doc"),
        ("rewrite", "SelfRAG.rewrite"),
        ("fallback", "SelfRAGQueryEngine.query"),
    ]
    # The fallback: the model answers alone, in a step of its own (a streamed answer too).
    assert tree[-3:] == [
        "  SelfRAG.generate",
        "    ReflectionCritic.agenerate",
        "      BatchedDecoder.complete",
    ]
    engine.streaming = True
    with recorded() as record:
        assert "".join(engine.query(QUESTION).response_gen)
    assert record.tree()[-2:] == ["  SelfRAG.generate", "    BatchedDecoder.complete"]
    assert record.tree()[:-2] == tree[:-3]


def test_a_regeneration_is_a_span_of_its_own(make_engine: Any) -> None:
    # Every paragraph is relevant, none fully supported: the best answer is regenerated once.
    engine = gated(
        make_engine,
        corrective=True,
        rewrite_threshold=0.0,
        support_threshold=1.0,
        max_regenerations=1,
    )
    with recorded() as record:
        meta = engine.query(QUESTION).metadata["self_rag"]
    (regenerate,) = record.named("SelfRAG.regenerate")
    tree = record.tree()
    at = tree.index("  SelfRAG.regenerate")
    assert tree[at + 1 : at + 3] == ["    ReflectionCritic.ajudge", "      BatchedDecoder.complete"]
    (step,) = [e for e in record.of(SelfRAGStepEvent) if e.step.kind == "regenerate"]
    assert record.span_of(step) == "SelfRAG.regenerate"
    assert step.step.as_dict() in meta["trace"]
    assert regenerate.parent_id == record.named("SelfRAGQueryEngine.query")[0].id_


def test_a_long_form_query_shows_each_depth_and_cited_segment(
    make_engine: Any, long_form_llm: Any
) -> None:
    engine = make_engine(
        llm=long_form_llm, long_form=True, beam_width=2, max_segments=3, max_new_tokens=30
    )
    stats = engine.critic.decoder.stats
    stats.reset()
    with recorded() as record:
        meta = engine.query(QUESTION).metadata["self_rag"]
    depths = record.named("SelfRAG.depth")
    assert len(depths) == meta["depth"] > 1
    tree = record.tree()
    assert tree[:2] == ["SelfRAGQueryEngine.query", "  SelfRAG.retrieve"]
    for depth in depths:
        writes = [s for s in record.named("ReflectionCritic.awrite_segments")]
        assert any(w.parent_id == depth.id_ for w in writes)
    # One Depth step per depth span, holding its candidates and which the beam kept.
    steps = [e for e in record.of(SelfRAGStepEvent) if e.step.kind == "depth"]
    assert [record.span_of(e) for e in steps] == ["SelfRAG.depth"] * len(depths)
    assert [[r.path_score for r in e.step.candidates if r.kept] for e in steps] == [
        [path["score"] for path in beam] for beam in meta["beams"]
    ]
    cited = record.of(SegmentCitedEvent)
    assert [(e.text, e.node_id, e.citation, e.score) for e in cited] == [
        (row["text"], row["node_id"], row["citation"], row["score"]) for row in meta["segments"]
    ]
    # The carried-over KV cache included, the calls add up to the decoder's counts.
    assert usage(record.events) == (stats.prompt_tokens, stats.generated_tokens)


def test_a_critic_over_an_llm_shows_the_llm_s_own_calls_once() -> None:
    llm = ScriptedLLM(lambda prompt: "Yes")
    engine = SelfRAGQueryEngine(
        critic=PromptedCritic.from_llm(llm),
        retriever=FixedRetriever(),
        mode="adaptive_retrieval",
        threshold=0.0,
    )
    with recorded() as record:
        engine.query(QUESTION)
    starts = record.of(LLMCompletionStartEvent)
    ends = record.of(LLMCompletionEndEvent)
    # One pair of the LLM's own events per request it answered, none added by the package.
    assert len(starts) == len(ends) == len(llm.prompts) > 3
    assert {e.model_dict["class_name"] for e in starts}.isdisjoint(tracing.CRITIC_MODELS)
    assert len({e.span_id for e in starts}) == len(starts)
    calls = record.named("ScriptedLLM.acomplete")
    assert len(calls) == len(starts)
    assert {name_of(call.parent_id) for call in calls} == {
        "PromptedCritic.adecide_retrieval",
        "PromptedCritic.ajudge",
    }


def test_nothing_is_built_while_nobody_listens(make_engine: Any) -> None:
    assert not tracing.observed()
    engine = gated(make_engine)
    built: list[Any] = []
    original = tracing.ModelCalls.__init__

    def spy(self: Any, name: str, model: str, prompts: Any) -> None:
        original(self, name, model, lambda: built.append(name) or prompts())

    tracing.ModelCalls.__init__ = spy  # type: ignore[method-assign]
    try:
        engine.query(QUESTION)
        assert built == []  # no prompt was turned into text
        with recorded():
            engine.query(QUESTION)
        assert built
    finally:
        tracing.ModelCalls.__init__ = original  # type: ignore[method-assign]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openinference_records_the_same_tree_with_token_counts(make_engine: Any) -> None:
    engine = gated(make_engine)
    stats = engine.critic.decoder.stats
    stats.reset()
    with openinference() as exporter:
        engine.query(QUESTION)
    spans = exporter.get_finished_spans()
    assert otel_tree(spans) == SHORT_FORM
    calls = [s for s in spans if s.name == "BatchedDecoder.complete"]
    assert all(s.attributes["openinference.span.kind"] == "LLM" for s in calls)
    prompt = sum(s.attributes["llm.token_count.prompt"] for s in calls)
    completion = sum(s.attributes["llm.token_count.completion"] for s in calls)
    assert (prompt, completion) == (stats.prompt_tokens, stats.generated_tokens)
    (gate,) = [s for s in spans if s.name == "SelfRAG.gate"]
    assert '"retrieve": true' in gate.attributes["output.value"]
    (judge,) = [s for s in spans if s.name == "SelfRAG.judge"]
    assert '"relevance"' in judge.attributes["output.value"]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("kind", ["long form", "corrective", "streamed"])
def test_every_kind_of_query_gives_one_tree_sync_async_and_in_openinference(
    kind: str, make_engine: Any, long_form_llm: Any, talkative_llm: Any
) -> None:
    options: dict[str, Any] = {
        "long form": {"llm": long_form_llm, "long_form": True, "max_segments": 2},
        "corrective": {"llm": talkative_llm, "corrective": True, "rewrite_threshold": 1.0},
        "streamed": {"llm": talkative_llm, "mode": "no_retrieval", "streaming": True},
    }[kind]
    engine = make_engine(max_new_tokens=20, **options)

    def read(response: Any) -> None:
        if kind == "streamed":
            assert "".join(response.response_gen)

    async def read_async() -> None:
        response = await engine.aquery(QUESTION)
        if kind == "streamed":
            assert "".join([piece async for piece in response.async_response_gen()])

    with recorded() as record:
        read(engine.query(QUESTION))
    tree = record.tree()
    assert len(tree) > 2 and record.spans.dropped_spans == []
    with recorded() as record:
        asyncio.run(read_async())
    assert synchronous(record.tree()) == tree
    with openinference() as exporter:
        read(engine.query(QUESTION))
    assert otel_tree(exporter.get_finished_spans()) == tree
