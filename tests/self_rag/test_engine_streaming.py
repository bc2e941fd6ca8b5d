"""The engine as LlamaIndex apps use engines: async on the README's sync-only Qdrant folder,
streaming (sync and async), and chat, on real parts (tiny GGUF, Qdrant local mode, MiniLM).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor, SelfRAGQueryEngine

QUESTION = "What does the while statement do?"


@pytest.fixture(scope="module")
def folder_index(corpus_nodes: Any, minilm: Any, tmp_path_factory: Any) -> Iterator[Any]:
    """The README's setup: Qdrant local mode in a folder, a sync client only."""
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    client = QdrantClient(path=str(tmp_path_factory.mktemp("qdrant")))
    store = QdrantVectorStore(client=client, collection_name="docs")
    nodes = [n.model_copy(deep=True) for n in corpus_nodes]
    index = VectorStoreIndex(
        nodes, storage_context=StorageContext.from_defaults(vector_store=store), embed_model=minilm
    )
    yield index
    client.close()


def same(a: Any, b: Any) -> None:
    assert str(a) == str(b)
    assert [s.node.node_id for s in a.source_nodes] == [s.node.node_id for s in b.source_nodes]
    assert [s.score for s in a.source_nodes] == pytest.approx([s.score for s in b.source_nodes])


def test_the_readme_store_has_no_async_client(folder_index: Any) -> None:
    # The premise of the tests below: core's own async retrieval fails on this store (the
    # wording is Qdrant's: only its type and its subject are asserted).
    with pytest.raises(ValueError, match=r"(?i)async"):
        asyncio.run(folder_index.as_retriever().aretrieve(QUESTION))


@pytest.mark.parametrize(
    "options",
    [{}, {"rse": True}, {"corrective": True, "rewrite_threshold": 1.0, "max_retrieval_rounds": 2}],
    ids=["plain", "rse", "corrective"],
)
def test_aquery_equals_query_on_a_sync_only_store(
    folder_index: Any, tiny_llm: Any, options: dict[str, Any]
) -> None:
    options = dict(options)
    post = (
        [RelevantSegmentPostprocessor(index=folder_index, preset="balanced")]
        if options.pop("rse", False)
        else []
    )
    engine = SelfRAGQueryEngine(
        llm=tiny_llm,
        retriever=folder_index.as_retriever(similarity_top_k=6),
        node_postprocessors=post,
        mode="always_retrieve",
        ndocs=3,
        **options,
    )
    same(asyncio.run(engine.aquery(QUESTION)), engine.query(QUESTION))


def test_rse_reads_chunks_async_from_a_sync_only_store(folder_index: Any) -> None:
    from llama_index.core.schema import QueryBundle

    rse = RelevantSegmentPostprocessor(index=folder_index, preset="balanced")
    hits = folder_index.as_retriever(similarity_top_k=8).retrieve(QUESTION)
    bundle = QueryBundle(QUESTION)
    sync = rse.postprocess_nodes(hits, query_bundle=bundle)
    asynced = asyncio.run(rse.apostprocess_nodes(hits, query_bundle=bundle))
    assert [n.node.get_content() for n in asynced] == [n.node.get_content() for n in sync]


def test_eight_concurrent_aqueries_on_one_engine_complete(folder_index: Any, tiny_llm: Any) -> None:
    engine = SelfRAGQueryEngine(
        llm=tiny_llm,
        retriever=folder_index.as_retriever(similarity_top_k=4),
        mode="always_retrieve",
        ndocs=2,
    )
    questions = [f"{QUESTION} ({i})" for i in range(8)]

    async def all_of_them() -> list[Any]:
        return list(await asyncio.gather(*(engine.aquery(q) for q in questions)))

    answers = asyncio.run(all_of_them())
    assert len(answers) == 8 and all(a.source_nodes for a in answers)
    assert str(answers[3]) == str(engine.query(questions[3]))


@pytest.mark.parametrize("mode", ["always_retrieve", "no_retrieval"])
def test_streaming_returns_the_same_text_and_sources(
    make_engine: Any, talkative_llm: Any, mode: str
) -> None:
    # The talkative model: the tiny one answers '' with no evidence, which any stream would join to.
    def build(streaming: bool) -> SelfRAGQueryEngine:
        return make_engine(llm=talkative_llm, mode=mode, streaming=streaming)

    plain = build(False).query(QUESTION)
    assert plain.response
    streamed = build(True).query(QUESTION)
    assert isinstance(streamed, StreamingResponse)
    assert streamed.metadata is not None and "self_rag" in streamed.metadata
    assert [s.node.node_id for s in streamed.source_nodes] == [
        s.node.node_id for s in plain.source_nodes
    ]
    assert streamed.get_response().response == plain.response
    assert str(streamed) == plain.response

    async def async_text() -> tuple[str, str]:
        response = await build(True).aquery(QUESTION)
        assert isinstance(response, AsyncStreamingResponse)
        pieces = [piece async for piece in response.async_response_gen()]
        full = await response.get_response()
        return "".join(pieces), str(full.response)

    joined, full = asyncio.run(async_text())
    assert joined == full == plain.response


def test_a_no_retrieval_answer_streams_token_by_token(talkative_llm: Any, make_engine: Any) -> None:
    def build(streaming: bool) -> SelfRAGQueryEngine:
        return make_engine(llm=talkative_llm, mode="no_retrieval", streaming=streaming)

    expected = build(False).query(QUESTION).response
    pieces = list(build(True).query(QUESTION).response_gen)
    assert len(pieces) > 1, pieces
    assert "".join(pieces) == expected

    async def async_pieces() -> list[str]:
        response = await build(True).aquery(QUESTION)
        return [piece async for piece in response.async_response_gen()]

    pieces = asyncio.run(async_pieces())
    assert len(pieces) > 1 and "".join(pieces) == expected


def test_the_prompted_critic_streams_through_its_llm() -> None:
    """An LLM that streams (here core's MockLLM, which echoes the prompt) streams the answer;
    one that does not (ScriptedLLM) answers in one piece; both give the non-streamed text.
    """
    from llama_index.core.llms import MockLLM
    from scripted import ScriptedLLM

    for llm, many in ((MockLLM(max_tokens=12), True), (ScriptedLLM(lambda p: " a b c "), False)):
        engine = SelfRAGQueryEngine(
            llm=llm, critic="prompted", retriever=FixedRetriever(), mode="no_retrieval"
        )
        expected = engine.query(QUESTION).response
        engine.streaming = True
        pieces = list(engine.query(QUESTION).response_gen)
        assert "".join(pieces) == expected
        assert (len(pieces) > 1) is many


def test_print_response_stream_prints_the_answer(make_engine: Any, capsys: Any) -> None:
    response = make_engine(streaming=True).query(QUESTION)
    response.print_response_stream()
    assert capsys.readouterr().out.strip() == str(response).strip()


@pytest.fixture
def chat_database() -> Iterator[Any]:
    """A database for core's chat ``Memory``, closed when the test ends.

    Core's default ``Memory`` opens an in-memory aiosqlite database of its own and never closes
    it. When the memory is garbage collected, aiosqlite schedules the close on the event loop
    current in the collecting thread; if that loop closes first (a test's ``asyncio.run``), the
    connection's worker thread raises "Event loop is closed" at some later test. A database the
    test owns is closed here instead (docs/async-streaming.md, "Chat").
    """
    from sqlalchemy.ext.asyncio import create_async_engine

    database = create_async_engine("sqlite+aiosqlite:///:memory:")
    yield database
    asyncio.run(database.dispose())


def test_chat_over_the_engine(make_engine: Any, chat_database: Any) -> None:
    from llama_index.core.chat_engine import CondenseQuestionChatEngine
    from llama_index.core.llms import MockLLM
    from llama_index.core.memory import Memory

    def chat_engine(streaming: bool) -> Any:
        engine = make_engine(streaming=streaming)
        memory = Memory.from_defaults(async_engine=chat_database)
        return CondenseQuestionChatEngine.from_defaults(
            query_engine=engine, llm=MockLLM(), memory=memory
        )

    def ids(nodes: Any) -> list[str]:
        return [n.node.node_id for n in nodes]

    expected = make_engine().query(QUESTION)
    answer = chat_engine(False).chat(QUESTION)
    assert answer.response == expected.response
    assert ids(answer.source_nodes) == ids(expected.source_nodes)
    assert chat_engine(True).chat(QUESTION).response == expected.response
    streamed = chat_engine(True).stream_chat(QUESTION)
    # The chat engine copies the sources when it wraps the stream, before it is read.
    assert ids(streamed.source_nodes) == ids(expected.source_nodes)
    assert "".join(streamed.response_gen) == expected.response
    asked = asyncio.run(chat_engine(False).achat(QUESTION))
    assert asked.response == expected.response

    async def astreamed() -> tuple[list[str], str]:
        answer = await chat_engine(True).astream_chat(QUESTION)
        # Core copies no sources from an AsyncStreamingResponse: they are on its tool output.
        sources = ids(answer.sources[0].raw_output.source_nodes)
        return sources, "".join([piece async for piece in answer.async_response_gen()])

    assert asyncio.run(astreamed()) == (ids(expected.source_nodes), expected.response)


def test_streamed_answers_close_cleanly_when_abandoned(
    talkative_llm: Any, make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A chat UI that stops listening: the critic's stream is closed at once, nothing is left
    pending (no task destroyed while pending, no coroutine never awaited), no thread is left
    behind, and the engine answers the next query.
    """
    engine = make_engine(llm=talkative_llm, mode="no_retrieval", streaming=True)
    expected = "".join(engine.query(QUESTION).response_gen)  # the threads it needs now exist
    critic = engine.critic
    original = critic.astream_generate
    closed: list[bool] = []

    async def watched(query: str) -> Any:
        try:
            async for piece in original(query):
                yield piece
        finally:
            closed.append(True)

    critic.astream_generate = watched  # type: ignore[method-assign]
    threads_before = set(threading.enumerate())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("WARNING"):
        warnings.simplefilter("always")
        response = engine.query(QUESTION)
        stream = response.response_gen
        first = next(stream)
        stream.close()
        assert first and expected.startswith(first)
        assert closed == [True]  # the critic's stream, closed with the reader's
        with pytest.raises(StopIteration):
            next(stream)
        del response, stream
        gc.collect()
        assert "".join(engine.query(QUESTION).response_gen) == expected  # the engine still answers
        gc.collect()
    left_behind = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert left_behind == []
    pending = [
        message
        for message in [str(w.message) for w in caught] + caplog.messages
        if "destroyed but it is pending" in message or "never awaited" in message
    ]
    assert pending == []
