"""SelfRAGQueryEngine on real llama.cpp (tiny Self-RAG GGUF) and its response contract."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading

import pytest
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import PARAGRAPHS, FixedRetriever, make_nodes

from llama_index.packs.self_rag_rse import ReflectionCritic, SelfRAGPack, SelfRAGQueryEngine


@pytest.fixture
def engine(make_engine):
    return make_engine()


def test_response_contract(engine, tiny_llm):
    response = engine.query("What does the while statement do?")
    meta = response.metadata["self_rag"]
    assert meta["critic"] == "reflection" and meta["retrieve"] is True
    assert [p["node_id"] for p in meta["paragraphs"]] == ["p-while", "p-for", "p-if"]
    best = meta["best"]
    assert response.response == meta["paragraphs"][best]["answer"].strip()
    # Sources are the original nodes (ids, metadata), scored with the final score, best first.
    assert response.source_nodes[0].node.node_id == meta["paragraphs"][best]["node_id"]
    assert response.source_nodes[0].node.metadata["source"] == "unit"
    rest = [s.score for s in response.source_nodes[1:]]
    assert rest == sorted(rest, reverse=True)
    for p in meta["paragraphs"]:
        expected = p["relevance"] + p["support"] + 0.5 * p["utility"]
        assert p["score"] == pytest.approx(expected)
    # The scores are the critic's own, computed once per paragraph from the real logits.
    critic = ReflectionCritic(tiny_llm)
    direct = critic.judge(
        "What does the while statement do?",
        [f"{t}\n{x}" if t else x for _, x, t in PARAGRAPHS],
    )
    for p, j in zip(meta["paragraphs"], direct, strict=True):
        assert p["relevance"] == pytest.approx(j.relevance, abs=1e-6)
        assert p["support"] == pytest.approx(j.support, abs=1e-6)
        assert p["utility"] == pytest.approx(j.utility, abs=1e-6)
        assert p["answer"] == j.answer


def test_weights_and_seqscore_change_the_ranking_formula(make_engine):
    engine = make_engine(w_rel=0.0, w_sup=2.0, w_use=1.0, use_seqscore=True)
    meta = engine.query("for loops?").metadata["self_rag"]
    for p in meta["paragraphs"]:
        assert p["seq_score"] is not None and 0.0 < p["seq_score"] <= 1.0
        assert p["score"] == pytest.approx(p["seq_score"] + 2.0 * p["support"] + p["utility"])


def test_drop_in_positional_constructor_and_generate_kwargs(tiny_gguf_paths):
    retriever = FixedRetriever()
    with SelfRAGQueryEngine(
        str(tiny_gguf_paths["user_defined"]),
        retriever,
        False,
        {"n_ctx": 512, "n_threads": 2},
        {"max_tokens": 12, "temperature": 0.0},
    ) as engine:
        assert engine.critic.name == "reflection" and engine.verbose is False
        # model_kwargs reach the model; generate_kwargs' max_tokens bounds every answer.
        assert engine.critic.llm.n_ctx() == 512  # type: ignore[attr-defined]
        assert engine.max_new_tokens == engine.critic.max_new_tokens == 12  # type: ignore[attr-defined]
        engine.mode = "always_retrieve"
        meta = engine.query("anything").metadata["self_rag"]
        assert retriever.queries == ["anything"] and len(meta["paragraphs"]) == 3


def test_llamacpp_wrapper_is_accepted(tiny_gguf_paths, make_engine, request):
    from llama_index.llms.llama_cpp import LlamaCPP

    llm = LlamaCPP(
        model_path=str(tiny_gguf_paths["control"]),
        model_kwargs={"n_ctx": 1024, "n_threads": 2},
        verbose=False,
    )
    request.addfinalizer(llm._model.close)
    engine = make_engine(llm=llm)
    assert engine.critic.name == "reflection"  # CONTROL-typed reflection tokens still work
    meta = engine.query("while?").metadata["self_rag"]
    assert len(meta["paragraphs"]) == 3
    assert all(0.0 <= p["relevance"] <= 1.0 for p in meta["paragraphs"])


def test_modes_and_threshold_gate(make_engine):
    retriever = FixedRetriever()
    never = make_engine(retriever=retriever, mode="no_retrieval")
    response = never.query("q")
    assert response.metadata["self_rag"]["retrieve"] is False and response.source_nodes == []
    assert retriever.queries == []

    always_gate = make_engine(retriever=retriever, mode="adaptive_retrieval", threshold=0.0)
    meta = always_gate.query("q").metadata["self_rag"]
    assert meta["retrieve"] is True and 0.0 < meta["retrieve_prob"] < 1.0
    never_gate = make_engine(retriever=retriever, mode="adaptive_retrieval", threshold=1.0)
    meta = never_gate.query("q").metadata["self_rag"]
    assert meta["retrieve"] is False and meta["paragraphs"] == []
    # The gate compares the same probability both times.
    assert meta["retrieve_prob"] == pytest.approx(
        always_gate.query("q").metadata["self_rag"]["retrieve_prob"], abs=1e-6
    )


def test_bad_input_is_named(tiny_llm, tiny_llm_plain, make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="query is empty"):
        engine.query("   ")
    with pytest.raises(ValueError, match="retriever"):
        SelfRAGQueryEngine(llm=tiny_llm)
    with pytest.raises(ValueError, match="model_path"):
        SelfRAGQueryEngine(retriever=FixedRetriever())
    with pytest.raises(ValueError, match=r"\[Retrieval\].*critic='prompted'"):
        SelfRAGQueryEngine(llm=tiny_llm_plain, retriever=FixedRetriever(), critic="reflection")
    with pytest.raises(ValueError, match="threshold"):
        SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever(), threshold=2.0)


def test_empty_retrieval_answers_without_evidence(make_engine):
    engine = make_engine(retriever=FixedRetriever([]))
    response = engine.query("q")
    meta = response.metadata["self_rag"]
    assert meta["retrieve"] is False and meta["best"] is None
    assert {"step": "fallback", "reason": "retriever returned no nodes"} in meta["trace"]
    assert response.source_nodes == []


def test_node_postprocessors_run_before_the_critic(make_engine):
    class KeepFirst(BaseNodePostprocessor):
        def _postprocess_nodes(self, nodes, query_bundle=None):
            return nodes[:1]

    meta = make_engine(node_postprocessors=[KeepFirst()]).query("q").metadata["self_rag"]
    assert [p["node_id"] for p in meta["paragraphs"]] == ["p-while"]
    assert len(make_engine(ndocs=2).query("q").metadata["self_rag"]["paragraphs"]) == 2


def test_aquery_and_concurrent_queries_agree(make_engine, talkative_llm):
    # The talkative model answers each query differently (the tiny one answers them alike), so a
    # query answered as another's does not go unseen.
    engine = make_engine(llm=talkative_llm)
    serial = [engine.query(q).response for q in ("a?", "b?", "c?")]
    assert len(set(serial)) == 3

    async def together():
        return await asyncio.gather(*(engine.aquery(q) for q in ("a?", "b?", "c?")))

    assert [r.response for r in asyncio.run(together())] == serial
    results: dict[int, str] = {}

    def worker(i: int, q: str) -> None:
        results[i] = engine.query(q).response

    threads = [
        threading.Thread(target=worker, args=(i, q)) for i, q in enumerate(("a?", "b?", "c?"))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == serial


def test_queries_whose_retriever_queries_an_engine_do_not_wait_on_each_other(make_engine):
    # A RecursiveRetriever routing to a Self-RAG engine queries it synchronously from inside
    # the outer query's retrieval. Blocking retrievals used to share one bounded thread pool
    # (cpu count + 4 threads): with more queries at once than that, every place was held by an
    # outer retrieval waiting for an inner query that waited for a place, and the process hung.
    inner = make_engine()
    callers = min(32, (os.cpu_count() or 1) + 4) + 2  # more than that pool ever had
    together = threading.Barrier(callers, timeout=30)  # all outer retrievals in flight at once

    class Routing:
        def retrieve(self, query_bundle):
            together.wait()
            answer = inner.query(query_bundle.query_str).response
            return [NodeWithScore(node=TextNode(text=f"Routed: {answer}"), score=1.0)]

    outer = make_engine(retriever=Routing())
    with concurrent.futures.ThreadPoolExecutor(callers) as pool:
        answers = list(pool.map(lambda i: outer.query(f"q {i}?").response, range(callers)))
    assert len(answers) == callers and not together.broken


class SyncOnly:
    """A retriever with a blocking ``retrieve()`` and nothing async, as many custom ones are."""

    def __init__(self) -> None:
        self.queries: list[str] = []

    def retrieve(self, query_bundle):
        self.queries.append(query_bundle.query_str)
        return make_nodes()


def test_a_sync_only_retriever_works_in_and_out_of_a_running_loop(make_engine):
    retriever = SyncOnly()
    engine = make_engine(retriever=retriever)
    outside = engine.query("while?")

    async def notebook_cell():  # a notebook runs its cells while its event loop runs
        return engine.query("while?")

    inside = asyncio.run(notebook_cell())
    assert retriever.queries == ["while?", "while?"]
    assert str(inside) == str(outside)
    assert [s.node.node_id for s in inside.source_nodes] == [
        s.node.node_id for s in outside.source_nodes
    ]


def test_query_events_are_emitted(engine, events):
    engine.query("q")
    assert "QueryStartEvent" in events and "QueryEndEvent" in events


def test_pack_and_legacy_import_path(tiny_gguf_paths):
    from llama_index.packs.self_rag_rse.base import SelfRAGQueryEngine as Legacy

    assert Legacy is SelfRAGQueryEngine
    with SelfRAGPack(
        str(tiny_gguf_paths["user_defined"]),
        FixedRetriever(),
        model_kwargs={"n_ctx": 1024, "n_threads": 2},
        mode="always_retrieve",
        ndocs=1,
    ) as pack:
        modules = pack.get_modules()
        assert modules["query_engine"].ndocs == 1  # kwargs reach the engine (upstream drops them)
        assert modules["critic"].name == "reflection"
        assert len(pack.run("q").metadata["self_rag"]["paragraphs"]) == 1


def test_verbose_prints_a_table(make_engine, capsys):
    engine = make_engine(verbose=True)
    capsys.readouterr()
    meta = engine.query("q").metadata["self_rag"]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Self-RAG [reflection] retrieve=True"
    assert lines[1].split() == ["#", "node", "rel", "sup", "use", "seq", "score", "answer"]
    # One row per judged paragraph, in judging order, the chosen one starred, with its scores.
    rows = lines[2:5]
    assert len(meta["paragraphs"]) == 3 and meta["best"] is not None
    for i, (line, paragraph) in enumerate(zip(rows, meta["paragraphs"], strict=True)):
        mark = "*" if i == meta["best"] else " "
        assert line.startswith(f"{mark}{i:>2} {paragraph['node_id']:<10} ")
        rel, sup, use, seq, score = line[14:].split()[:5]
        assert rel == f"{paragraph['relevance']:.2f}" and sup == f"{paragraph['support']:.2f}"
        assert use == f"{paragraph['utility']:+.2f}"
        assert seq == f"{paragraph['seq_score']:.2f}"  # the reflection critic reads one
        assert score == f"{paragraph['score']:.2f}"
        assert line.rstrip().endswith(paragraph["answer"].replace("\n", " ")[:60].rstrip())
    assert [line for line in lines if line.startswith("*")] == [rows[meta["best"]]]
    # Then the trace, one step per line.
    assert lines[5:] == [f"  trace: {entry}" for entry in meta["trace"]]


def test_verbose_on_a_console_that_cannot_encode_the_text(make_engine, monkeypatch):
    # On a cp1252 or ASCII console the table raised UnicodeEncodeError after all the work, and
    # the answer was lost.
    import io
    import sys

    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", console)
    response = make_engine(verbose=True).query("Qu'est-ce qu'un café « while » ?")
    console.flush()
    assert response.response
    assert "caf\\xe9" in console.buffer.getvalue().decode("ascii")
