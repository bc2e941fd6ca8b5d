"""The corrective loop's branches and limits, driven by a scripted critic.

A real model cannot be made to produce "irrelevant, then relevant after query2doc" on demand, so
the critic here is scripted: it scores paragraphs from a table and records every call.
"""

from __future__ import annotations

import asyncio

import pytest
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.schema import NodeWithScore, QueryBundle, TextNode
from scripted import BlockingCritic

from llama_index.packs.self_rag_rse import ParagraphJudgement, RetrievalDecision, SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.critic.prompts import ENGINE_PROMPTS
from llama_index.packs.self_rag_rse.self_rag.flow import NO_ANSWER

QUESTION = "Who wrote the while statement?"
PSEUDO_DOC = "A passage about loops."
REWRITTEN = "while statement author"


GROUNDED = ENGINE_PROMPTS["grounded_prompt"].format(query_str=QUESTION)
QUERY2DOC = ENGINE_PROMPTS["query2doc_prompt"].format(query_str=QUESTION)
REWRITE = ENGINE_PROMPTS["rewrite_prompt"].format(query_str=QUESTION)


class ScriptedCritic(BlockingCritic):
    """Judges paragraphs from a table {paragraph text: (relevance, support, utility)}."""

    name = "scripted"

    def __init__(self, table, regenerated=None):
        self.table = table
        self.regenerated = regenerated or {}
        self.judged: list[tuple[str, list[str]]] = []
        self.generated: list[str] = []

    def decide_retrieval(self, query, threshold, answer_if_skipped=True):
        return RetrievalDecision(retrieve=True, probability=0.9)

    def judge(self, query, paragraphs):
        self.judged.append((query, list(paragraphs)))
        table = self.regenerated if query == GROUNDED else self.table
        out = []
        for p in paragraphs:
            rel, sup, use = table[p]
            out.append(
                ParagraphJudgement(
                    answer=f"answer from {p}", relevance=rel, support=sup, utility=use
                )
            )
        return out

    def generate(self, text):
        self.generated.append(text)
        if text == QUERY2DOC:
            return PSEUDO_DOC
        if text == REWRITE:
            return REWRITTEN
        return "model-only answer"


class RoutingRetriever(BaseRetriever):
    """Returns the paragraphs listed for each search string."""

    def __init__(self, routes):
        super().__init__()
        self.routes = routes
        self.queries: list[str] = []

    def _retrieve(self, query_bundle: QueryBundle):
        self.queries.append(query_bundle.query_str)
        return [
            NodeWithScore(node=TextNode(id_=text, text=text), score=1.0)
            for text in self.routes.get(query_bundle.query_str, [])
        ]


def engine_for(critic, retriever, **options):
    return SelfRAGQueryEngine(retriever=retriever, critic=critic, corrective=True, **options)


def steps(response):
    return [entry["step"] for entry in response.metadata["self_rag"]["trace"]]


def test_off_by_default_no_extra_rounds():
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"]})
    response = SelfRAGQueryEngine(retriever=retriever, critic=critic).query(QUESTION)
    assert retriever.queries == [QUESTION]
    assert response.response == "answer from junk"


def test_query2doc_recovers_relevant_paragraphs():
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0), "gold": (0.9, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["gold"]})
    response = engine_for(critic, retriever).query(QUESTION)
    assert retriever.queries == [QUESTION, PSEUDO_DOC]
    assert steps(response) == ["decide", "retrieve", "query2doc", "retrieve"]
    assert response.response == "answer from gold"
    # Judged against the user's question, not the pseudo-document.
    assert all(query == QUESTION for query, _ in critic.judged)
    assert [p["node_id"] for p in response.metadata["self_rag"]["paragraphs"]] == ["junk", "gold"]


def test_rewrite_after_query2doc_then_fallback_when_every_round_fails():
    critic = ScriptedCritic(
        {"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0), "junk3": (0.3, 0.9, 1.0)}
    )
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"], REWRITTEN: ["junk3"]})
    response = engine_for(critic, retriever, max_retrieval_rounds=3).query(QUESTION)
    assert retriever.queries == [QUESTION, PSEUDO_DOC, REWRITTEN]
    assert steps(response) == [
        "decide",
        "retrieve",
        "query2doc",
        "retrieve",
        "rewrite",
        "retrieve",
        "fallback",
    ]
    assert response.response == "model-only answer"  # never empty
    assert response.metadata["self_rag"]["best"] is None


def test_round_limit_is_respected():
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"]})
    response = engine_for(critic, retriever, max_retrieval_rounds=1).query(QUESTION)
    assert retriever.queries == [QUESTION]
    assert "query2doc" not in steps(response)
    assert response.response == "model-only answer"


def test_duplicate_nodes_across_rounds_are_judged_once():
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0), "gold": (0.9, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["junk", "gold"]})
    response = engine_for(critic, retriever).query(QUESTION)
    judged = [p for _, ps in critic.judged for p in ps]
    assert judged == ["junk", "gold"]
    assert response.response == "answer from gold"


def test_unsupported_answer_is_regenerated_once():
    critic = ScriptedCritic({"gold": (0.9, 0.1, 1.0)}, regenerated={"gold": (0.9, 0.8, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["gold"]})
    response = engine_for(critic, retriever, max_regenerations=2).query(QUESTION)
    assert steps(response).count("regenerate") == 1  # stopped once supported
    assert critic.judged[-1][0] == GROUNDED
    assert response.metadata["self_rag"]["paragraphs"][0]["support"] == pytest.approx(0.8)


def test_regeneration_limit_then_next_best_supported_paragraph():
    table = {"gold": (0.95, 0.1, 1.0), "silver": (0.8, 0.7, 0.0)}
    critic = ScriptedCritic(table, regenerated={"gold": (0.95, 0.2, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["gold", "silver"]})
    response = engine_for(critic, retriever, max_regenerations=2).query(QUESTION)
    assert steps(response).count("regenerate") == 2
    assert "next_best" in steps(response)
    assert response.response == "answer from silver"
    assert response.source_nodes[0].node.node_id == "silver"


def test_low_utility_triggers_a_rewrite_not_query2doc():
    critic = ScriptedCritic({"meh": (0.9, 0.9, -0.5), "good": (0.9, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["meh"], REWRITTEN: ["good"]})
    response = engine_for(critic, retriever).query(QUESTION)
    assert retriever.queries == [QUESTION, REWRITTEN]
    assert "rewrite" in steps(response) and "query2doc" not in steps(response)
    assert response.response == "answer from good"


def test_loop_runs_the_same_under_aquery():
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0), "gold": (0.9, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["gold"]})
    response = asyncio.run(engine_for(critic, retriever).aquery(QUESTION))
    assert steps(response) == ["decide", "retrieve", "query2doc", "retrieve"]
    assert response.response == "answer from gold"


def test_failed_paragraph_does_not_lose_the_others():
    class Failing(ScriptedCritic):
        def judge(self, query, paragraphs):
            out = super().judge(query, paragraphs)
            out[0] = ParagraphJudgement("", 0.0, 0.0, 0.0, error="decode failed")
            return out

    critic = Failing({"bad": (0.9, 0.9, 1.0), "gold": (0.8, 0.8, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["bad", "gold"]})
    response = SelfRAGQueryEngine(retriever=retriever, critic=critic).query(QUESTION)
    assert response.response == "answer from gold"
    paragraphs = response.metadata["self_rag"]["paragraphs"]
    assert paragraphs[0]["error"] == "decode failed" and paragraphs[0]["score"] is None


def test_corrective_answer_comes_from_a_relevant_paragraph():
    # The irrelevant paragraph outscores the relevant one on the raw formula (1.9 vs 1.2).
    critic = ScriptedCritic({"glib": (0.4, 1.0, 1.0), "gold": (0.6, 0.6, 0.0)})
    retriever = RoutingRetriever({QUESTION: ["glib", "gold"]})
    assert SelfRAGQueryEngine(retriever=retriever, critic=critic).query(QUESTION).response == (
        "answer from glib"
    )
    response = engine_for(critic, retriever).query(QUESTION)
    assert response.response == "answer from gold"
    assert retriever.queries == [QUESTION, QUESTION]  # no extra round was needed


def test_never_an_empty_response():
    class Mute(ScriptedCritic):
        def generate(self, text):
            answer = super().generate(text)
            return "" if text == QUESTION else answer

    critic = Mute({"junk": (0.1, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"]})
    response = engine_for(critic, retriever, max_retrieval_rounds=1).query(QUESTION)
    assert response.response == NO_ANSWER
    assert steps(response)[-2:] == ["fallback", "no_answer"]


def test_a_regeneration_that_repeats_the_last_one_stops_the_regenerations():
    # A greedy critic writes the same answer from the same grounded prompt every time: the
    # loop used to ask it max_regenerations times.
    critic = ScriptedCritic({"gold": (0.9, 0.1, 1.0)}, regenerated={"gold": (0.9, 0.2, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["gold"]})
    response = engine_for(critic, retriever, max_regenerations=5).query(QUESTION)
    assert [query for query, _ in critic.judged].count(GROUNDED) == 2
    assert steps(response)[-4:] == ["regenerate", "regenerate", "repeated", "keep_best"]
    assert response.metadata["self_rag"]["trace"][-2] == {
        "step": "repeated",
        "reason": "the same answer as the attempt before: a greedy critic would write it again",
    }
    assert response.response == "answer from gold"


def test_regenerations_that_differ_use_every_attempt():
    class Sampling(ScriptedCritic):
        def judge(self, query, paragraphs):
            out = super().judge(query, paragraphs)
            if query == GROUNDED:
                out[0].answer = f"attempt {len(self.judged)}"
            return out

    critic = Sampling({"gold": (0.9, 0.1, 1.0)}, regenerated={"gold": (0.9, 0.2, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["gold"]})
    response = engine_for(critic, retriever, max_regenerations=3).query(QUESTION)
    assert steps(response).count("regenerate") == 3
    assert "repeated" not in steps(response)


def test_a_rewrite_already_searched_does_not_search_again():
    # The rewrite prompt holds only the question: a greedy critic rewrites it the same way
    # every round, and the loop used to search that text again and again.
    critic = ScriptedCritic({"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0)})
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"]})
    response = engine_for(critic, retriever, max_retrieval_rounds=6).query(QUESTION)
    assert retriever.queries == [QUESTION, PSEUDO_DOC, REWRITTEN]
    assert critic.generated.count(REWRITE) == 2
    assert steps(response) == [
        "decide",
        "retrieve",
        "query2doc",
        "retrieve",
        "rewrite",
        "retrieve",
        "rewrite",
        "repeated",
        "fallback",
    ]
    assert response.metadata["self_rag"]["trace"][-2] == {
        "step": "repeated",
        "reason": "the text was searched already: the loop stops",
    }
