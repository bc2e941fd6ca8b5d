"""Long-form Self-RAG in the engine: options, outcomes, streaming, async, the pack, verbose.

The model is a tiny Self-RAG GGUF whose answers go on after their utility token (seed 3,
``long_form=True``), so answers have several segments. Exactness against an independent
implementation is in ``test_long_form_exact.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.schema import NodeWithScore, QueryBundle
from retrievers import FixedRetriever, make_nodes

from llama_index.packs.self_rag_rse import ReflectionCritic, SelfRAGQueryEngine

QUESTION = "What does the while statement do?"
CARRIED = "Who wrote Hamlet?"  # a path finished at depth 1 outranks every child at depth 2
MAX_NEW = 30


@pytest.fixture
def llm(long_form_llm: Any) -> Any:
    return long_form_llm


@pytest.fixture
def engine(make_engine: Any, llm: Any) -> Callable[..., SelfRAGQueryEngine]:
    """Long-form engines on the long-form model (closed when the test ends)."""

    def build(retriever: Any = None, **options: Any) -> SelfRAGQueryEngine:
        settings: dict[str, Any] = dict(long_form=True, beam_width=2, max_segments=4)
        settings.update(options)
        return make_engine(
            llm=llm, retriever=retriever or FixedRetriever(), max_new_tokens=MAX_NEW, **settings
        )

    return build


def test_the_answer_cites_each_segments_passage(engine: Any) -> None:
    response = engine().query(QUESTION)
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


def test_a_finished_path_is_carried_over_and_can_win(engine: Any) -> None:
    meta = engine().query(CARRIED).metadata["self_rag"]
    assert meta["depth"] > len(meta["segments"])  # the winner stopped growing before the end
    depths = [t for t in meta["trace"] if t["step"] == "depth"]
    carried = [c for c in depths[-1]["candidates"] if c["finished"] and c["kept"]]
    assert carried and carried[0]["rank"] == 0


def test_per_segment_retrieval_asks_with_the_last_segment(engine: Any) -> None:
    retriever = FixedRetriever()
    meta = engine(retriever).query(QUESTION).metadata["self_rag"]
    assert retriever.queries[0] == QUESTION
    later = retriever.queries[1:]
    assert later and all(q.startswith(QUESTION + " ") for q in later)
    texts = {t["query"] for t in meta["trace"] if t["step"] == "retrieve"}
    assert set(retriever.queries) == texts
    once = FixedRetriever()
    engine(once, segment_retrieval="once").query(QUESTION)
    assert once.queries == [QUESTION]


class Vanishing(FixedRetriever):
    """Passages for the question, nothing for the follow-up queries."""

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        nodes = super()._retrieve(query_bundle)
        return nodes if query_bundle.query_str == QUESTION else []


def test_a_path_without_passages_finishes_and_the_trace_says_why(engine: Any) -> None:
    meta = engine(Vanishing()).query(QUESTION).metadata["self_rag"]
    finished = [t for t in meta["trace"] if t["step"] == "path_finished"]
    assert finished and {t["reason"] for t in finished} == {"no passages"}
    assert meta["depth"] == 2 and len(meta["segments"]) == 1


def test_no_retrieval_gives_the_short_form_answer_without_citations(engine: Any) -> None:
    long_form = engine(mode="no_retrieval").query(QUESTION)
    short = engine(mode="no_retrieval", long_form=False).query(QUESTION)
    assert long_form.response == short.response and "[" not in long_form.response
    meta = long_form.metadata["self_rag"]
    assert meta["long_form"] is True and meta["segments"] == [] and not long_form.source_nodes


def test_ndocs_and_postprocessors_choose_the_passages(engine: Any) -> None:
    meta = engine(ndocs=1).query(QUESTION).metadata["self_rag"]
    assert {r["node_id"] for r in meta["segments"]} == {make_nodes()[0].node.node_id}
    assert all(len(b) <= 2 for b in meta["beams"])


def test_aquery_equals_query(engine: Any) -> None:
    plain = engine().query(QUESTION)
    result = asyncio.run(engine().aquery(QUESTION))
    assert result.response == plain.response
    assert result.metadata["self_rag"]["segments"] == plain.metadata["self_rag"]["segments"]


def ids(nodes: list[NodeWithScore]) -> list[str]:
    return [n.node.node_id for n in nodes]


@pytest.mark.parametrize("beam_width", [1, 2])
def test_a_streamed_answer_has_its_sources_and_comes_segment_by_segment(
    engine: Any, beam_width: int
) -> None:
    plain = engine(beam_width=beam_width).query(QUESTION)
    rows = plain.metadata["self_rag"]["segments"]
    streamed = engine(beam_width=beam_width, streaming=True).query(QUESTION)
    assert isinstance(streamed, StreamingResponse)
    # Sources and metadata are complete when the response is handed out, before it is read.
    assert ids(streamed.source_nodes) == ids(plain.source_nodes) and len(plain.source_nodes) > 1
    assert streamed.metadata["self_rag"]["segments"] == rows
    pieces = list(streamed.response_gen)
    assert len(pieces) == len([r for r in rows if r["text"]]) > 1
    assert "".join(pieces) == plain.response

    async def read() -> tuple[list[str], list[str]]:
        response = await engine(beam_width=beam_width, streaming=True).aquery(QUESTION)
        assert isinstance(response, AsyncStreamingResponse)
        sources = ids(response.source_nodes)
        return [p async for p in response.async_response_gen()], sources

    pieces, sources = asyncio.run(read())
    assert "".join(pieces) == plain.response and sources == ids(plain.source_nodes)


@pytest.mark.parametrize("beam_width", [1, 2])
def test_chat_engines_stream_long_form_answers_with_their_sources(
    engine: Any, llm: Any, beam_width: int
) -> None:
    """Core's chat engine copies the sources when it wraps the streamed response, before the
    stream is read: they must be there by then.
    """
    from llama_index.core.chat_engine import CondenseQuestionChatEngine
    from llama_index.core.llms import MockLLM
    from llama_index.core.tools import QueryEngineTool

    plain = engine(beam_width=beam_width).query(QUESTION)

    def chat() -> CondenseQuestionChatEngine:
        streamed = engine(beam_width=beam_width, streaming=True)
        return CondenseQuestionChatEngine.from_defaults(query_engine=streamed, llm=MockLLM())

    answer = chat().stream_chat(QUESTION)
    assert ids(answer.source_nodes) == ids(plain.source_nodes) and answer.source_nodes
    assert "".join(answer.response_gen) == plain.response

    async def achat() -> tuple[list[str], str]:
        answer = await chat().astream_chat(QUESTION)
        # Core (0.14) copies source_nodes from a Response or StreamingResponse only, never from
        # an AsyncStreamingResponse (any engine's): they are on the tool output it keeps.
        sources = ids(answer.sources[0].raw_output.source_nodes)
        return sources, "".join([p async for p in answer.async_response_gen()])

    sources, text = asyncio.run(achat())
    assert sources == ids(plain.source_nodes) and text == plain.response
    tool = QueryEngineTool.from_defaults(engine(beam_width=beam_width, streaming=True))
    output = tool.call(QUESTION)
    assert ids(output.raw_output.source_nodes) == ids(plain.source_nodes)


def test_verbose_prints_a_table_per_depth(engine: Any, capsys: pytest.CaptureFixture[str]) -> None:
    engine(verbose=True).query(QUESTION)
    out = capsys.readouterr().out
    assert "depth 1:" in out and "depth 2:" in out
    assert "path" in out and "segment" in out


def test_the_pack_takes_long_form(llm: Any) -> None:
    from llama_index.packs.self_rag_rse import SelfRAGPack

    with SelfRAGPack(llm=llm, retriever=FixedRetriever(), long_form=True) as pack:
        assert pack.query_engine.long_form is True
        response = pack.run(QUESTION)
    assert response.metadata["self_rag"]["long_form"] is True


def test_each_depth_is_a_span(engine: Any) -> None:
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.span_handlers import SimpleSpanHandler

    handler = SimpleSpanHandler()
    root = get_dispatcher()
    root.add_span_handler(handler)
    try:
        meta = engine().query(QUESTION).metadata["self_rag"]
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
def test_bad_long_form_options_are_refused(engine: Any, options: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine(**options)


def test_an_unknown_segment_retrieval_is_refused(engine: Any) -> None:
    with pytest.raises(ValueError, match="segment_retrieval"):
        engine(segment_retrieval="each")


def test_the_prompted_critic_refuses_long_form_and_names_the_alternatives() -> None:
    from scripted import ScriptedLLM

    with pytest.raises(ValueError, match="needs a Self-RAG model") as caught:
        SelfRAGQueryEngine(
            llm=ScriptedLLM(lambda p: "Yes"), retriever=FixedRetriever(), long_form=True
        )
    assert "long_form=False" in str(caught.value) and "corrective=True" in str(caught.value)


def test_a_critic_given_as_built_is_checked_too(llm: Any, make_engine: Any) -> None:
    with ReflectionCritic(llm, max_new_tokens=MAX_NEW) as critic:
        assert make_engine(critic=critic, long_form=True).critic is critic


def test_a_context_that_outgrows_n_ctx_finishes_the_path_and_says_why(
    llm: Any, make_engine: Any
) -> None:
    with ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_ctx=90) as critic:
        engine = make_engine(critic=critic, long_form=True, max_segments=4, max_new_tokens=MAX_NEW)
        response = engine.query(QUESTION)
    trace = response.metadata["self_rag"]["trace"]
    failed = [t for t in trace if t["step"] == "segment_failed"]
    assert failed and all("leaves no room for a passage" in t["error"] for t in failed)
    assert any(t.get("reason") == "every continuation failed" for t in trace)
    assert response.metadata["self_rag"]["segments"] and response.source_nodes


def test_a_passage_cut_to_fit_n_ctx_is_shown_in_its_segments_row(
    llm: Any, engine: Any, make_engine: Any
) -> None:
    whole = engine().query(QUESTION).metadata["self_rag"]["segments"]
    assert [row["passage_cut"] for row in whole] == [0] * len(whole)
    with ReflectionCritic(llm, max_new_tokens=MAX_NEW, n_ctx=120) as critic:
        cut = make_engine(critic=critic, long_form=True, max_segments=4, max_new_tokens=MAX_NEW)
        rows = cut.query(QUESTION).metadata["self_rag"]["segments"]
    # Depth 1 fits; at depth 2 the path's context leaves less room than the passage needs.
    assert rows[0]["passage_cut"] == 0 and rows[-1]["passage_cut"] > 0
