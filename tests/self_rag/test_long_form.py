"""Long-form Self-RAG in the engine: options, outcomes, streaming, async, the pack, verbose.

The model is a tiny Self-RAG GGUF whose answers go on after their utility token (seed 3,
``long_form=True``), so answers have several segments. Exactness against an independent
implementation is in ``test_long_form_exact.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.schema import NodeWithScore, QueryBundle
from retrievers import FixedRetriever, make_nodes

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

QUESTION = "What does the while statement do?"
CARRIED = "Who wrote Hamlet?"  # a path finished at depth 1 outranks every child at depth 2
MAX_NEW = 30


@pytest.fixture(scope="module")
def llm(long_form_ggufs: dict[str, Path]) -> Iterator[Any]:
    from conftest import _llama

    model = _llama(long_form_ggufs["user_defined"])
    yield model
    model.close()


def engine(llm: Any, retriever: Any = None, **options: Any) -> SelfRAGQueryEngine:
    settings: dict[str, Any] = dict(
        mode="always_retrieve", long_form=True, beam_width=2, max_segments=4
    )
    settings.update(options)
    return SelfRAGQueryEngine(
        llm=llm, retriever=retriever or FixedRetriever(), max_new_tokens=MAX_NEW, **settings
    )


def test_the_answer_cites_each_segments_passage(llm: Any) -> None:
    response = engine(llm).query(QUESTION)
    meta = response.metadata["self_rag"]
    assert meta["long_form"] is True and meta["retrieve"] is True
    rows = meta["segments"]
    assert len(rows) > 1 and meta["depth"] == len(meta["beams"]) > 1
    cited = [n.node.node_id for n in response.source_nodes]
    assert len(cited) == len(set(cited)) > 1
    parts = [f"{r['text']} [{r['citation']}]" for r in rows if r["text"]]
    assert response.response == " ".join(parts)
    for row in rows:
        if row["text"]:
            assert cited[row["citation"] - 1] == row["node_id"]
    # Sources in order of first citation, with the citing segment's score.
    first = list(dict.fromkeys(r["node_id"] for r in rows if r["text"]))
    assert cited == first
    assert meta["path_score"] == pytest.approx(sum(r["score"] for r in rows) / len(rows))
    assert meta["beams"][-1][0]["score"] == pytest.approx(meta["path_score"])


def test_a_finished_path_is_carried_over_and_can_win(llm: Any) -> None:
    meta = engine(llm).query(CARRIED).metadata["self_rag"]
    assert meta["depth"] > len(meta["segments"])  # the winner stopped growing before the end
    depths = [t for t in meta["trace"] if t["step"] == "depth"]
    carried = [c for c in depths[-1]["candidates"] if c["finished"] and c["kept"]]
    assert carried and carried[0]["rank"] == 0


def test_per_segment_retrieval_asks_with_the_last_segment(llm: Any) -> None:
    retriever = FixedRetriever()
    meta = engine(llm, retriever).query(QUESTION).metadata["self_rag"]
    assert retriever.queries[0] == QUESTION
    later = retriever.queries[1:]
    assert later and all(q.startswith(QUESTION + " ") for q in later)
    texts = {t["query"] for t in meta["trace"] if t["step"] == "retrieve"}
    assert set(retriever.queries) == texts
    once = FixedRetriever()
    engine(llm, once, segment_retrieval="once").query(QUESTION)
    assert once.queries == [QUESTION]


class Vanishing(FixedRetriever):
    """Passages for the question, nothing for the follow-up queries."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = super()._retrieve(query_bundle)
        return nodes if query_bundle.query_str == QUESTION else []


def test_a_path_without_passages_finishes_and_the_trace_says_why(llm: Any) -> None:
    meta = engine(llm, Vanishing()).query(QUESTION).metadata["self_rag"]
    finished = [t for t in meta["trace"] if t["step"] == "path_finished"]
    assert finished and {t["reason"] for t in finished} == {"no passages"}
    assert meta["depth"] == 2 and len(meta["segments"]) == 1


def test_no_retrieval_gives_the_short_form_answer_without_citations(llm: Any) -> None:
    long_form = engine(llm, mode="no_retrieval").query(QUESTION)
    short = engine(llm, mode="no_retrieval", long_form=False).query(QUESTION)
    assert long_form.response == short.response and "[" not in long_form.response
    meta = long_form.metadata["self_rag"]
    assert meta["long_form"] is True and meta["segments"] == [] and not long_form.source_nodes


def test_ndocs_and_postprocessors_choose_the_passages(llm: Any) -> None:
    meta = engine(llm, ndocs=1).query(QUESTION).metadata["self_rag"]
    assert {r["node_id"] for r in meta["segments"]} == {make_nodes()[0].node.node_id}
    assert all(len(b) <= 2 for b in meta["beams"])


def test_aquery_equals_query(llm: Any) -> None:
    plain = engine(llm).query(QUESTION)
    result = asyncio.run(engine(llm).aquery(QUESTION))
    assert result.response == plain.response
    assert result.metadata["self_rag"]["segments"] == plain.metadata["self_rag"]["segments"]


def test_one_path_streams_segment_by_segment(llm: Any) -> None:
    plain = engine(llm, beam_width=1).query(QUESTION)
    streamed = engine(llm, beam_width=1, streaming=True).query(QUESTION)
    assert isinstance(streamed, StreamingResponse)
    pieces = list(streamed.response_gen)
    assert len(pieces) == len([r for r in plain.metadata["self_rag"]["segments"] if r["text"]])
    assert len(pieces) > 1 and "".join(pieces) == plain.response
    assert [n.node.node_id for n in streamed.source_nodes] == [
        n.node.node_id for n in plain.source_nodes
    ]
    assert streamed.metadata["self_rag"]["segments"] == plain.metadata["self_rag"]["segments"]

    async def read() -> tuple[list[str], AsyncStreamingResponse]:
        response = await engine(llm, beam_width=1, streaming=True).aquery(QUESTION)
        assert isinstance(response, AsyncStreamingResponse)
        return [p async for p in response.async_response_gen()], response

    pieces, response = asyncio.run(read())
    assert "".join(pieces) == plain.response and len(response.source_nodes) > 1


def test_a_wider_beam_streams_the_answer_when_the_search_ends(llm: Any) -> None:
    plain = engine(llm).query(QUESTION)
    pieces = list(engine(llm, streaming=True).query(QUESTION).response_gen)
    assert pieces == [plain.response]


def test_verbose_prints_a_table_per_depth(llm: Any, capsys: pytest.CaptureFixture[str]) -> None:
    engine(llm, verbose=True).query(QUESTION)
    out = capsys.readouterr().out
    assert "depth 1:" in out and "depth 2:" in out
    assert "path" in out and "segment" in out


def test_the_pack_takes_long_form(llm: Any) -> None:
    from llama_index.packs.self_rag_rse import SelfRAGPack

    with SelfRAGPack(llm=llm, retriever=FixedRetriever(), long_form=True) as pack:
        assert pack.query_engine.long_form is True
        response = pack.run(QUESTION)
    assert response.metadata["self_rag"]["long_form"] is True


def test_each_depth_is_a_span(llm: Any) -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

    handler = SimpleSpanHandler()
    root = get_dispatcher()
    root.add_span_handler(handler)
    try:
        meta = engine(llm).query(QUESTION).metadata["self_rag"]
    finally:
        root.span_handlers.remove(handler)
    names = [span.id_.split("-")[0] for span in handler.completed_spans]
    assert names.count("ReflectionCritic.awrite_segments") == meta["depth"]
    assert "SelfRAGQueryEngine.query" in names


@pytest.mark.parametrize(
    "options, message",
    [
        ({"beam_width": 0}, "beam_width must be at least 1"),
        ({"max_segments": 0}, "max_segments must be at least 1"),
        ({"corrective": True}, "cannot be combined"),
    ],
)
def test_bad_long_form_options_are_refused(llm: Any, options: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine(llm, **options)


def test_an_unknown_segment_retrieval_is_refused(llm: Any) -> None:
    with pytest.raises(ValueError, match="segment_retrieval"):
        engine(llm, segment_retrieval="each")


def test_the_prompted_critic_refuses_long_form_and_names_the_alternatives() -> None:
    from scripted import ScriptedLLM

    with pytest.raises(ValueError, match="needs a Self-RAG model") as caught:
        SelfRAGQueryEngine(
            llm=ScriptedLLM(lambda p: "Yes"), retriever=FixedRetriever(), long_form=True
        )
    assert "long_form=False" in str(caught.value) and "corrective=True" in str(caught.value)


def test_a_critic_given_as_built_is_checked_too(llm: Any) -> None:
    critic = ReflectionCritic(llm, max_new_tokens=MAX_NEW)
    try:
        assert SelfRAGQueryEngine(critic=critic, retriever=FixedRetriever(), long_form=True)
    finally:
        critic.close()


def test_a_context_that_outgrows_n_ctx_finishes_the_path_and_says_why(llm: Any) -> None:
    critic = ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_ctx=90)
    try:
        engine_ = SelfRAGQueryEngine(
            critic=critic,
            retriever=FixedRetriever(),
            mode="always_retrieve",
            long_form=True,
            max_segments=4,
            max_new_tokens=MAX_NEW,
        )
        response = engine_.query(QUESTION)
    finally:
        critic.close()
    trace = response.metadata["self_rag"]["trace"]
    failed = [t for t in trace if t["step"] == "segment_failed"]
    assert failed and all("leaves no room for a passage" in t["error"] for t in failed)
    assert any(t.get("reason") == "every continuation failed" for t in trace)
    assert response.metadata["self_rag"]["segments"] and response.source_nodes
