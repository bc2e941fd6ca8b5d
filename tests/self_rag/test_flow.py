"""The Self-RAG flow driven through :class:`FlowParts`, with no engine built.

The forms take a record of parts (the critic, a retrieval function, the score, the paragraph
text, the prompts, ``ndocs``, the query's record); here the critic judges from tables and the
retrieval answers from routes, so the short form, the long form and every branch of the
corrective loop run on demand, and each test reads the outcome and the typed record.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import routed_nodes
from scripted import TableCritic

from llama_index.packs.self_rag_rse.critic.checked import CheckedCritic
from llama_index.packs.self_rag_rse.critic.contract import Continuation, ParagraphJudgement
from llama_index.packs.self_rag_rse.critic.prompts import ENGINE_PROMPTS
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts
from llama_index.packs.self_rag_rse.self_rag.long_form import long_form
from llama_index.packs.self_rag_rse.self_rag.record import (
    Depth,
    Fallback,
    KeepBest,
    NextBest,
    PathFinished,
    Query2Doc,
    QueryRecord,
    Regenerate,
    Repeated,
    Retrieve,
    Rewrite,
    SegmentFailed,
    SkipEmpty,
)
from llama_index.packs.self_rag_rse.self_rag.retrieval import Retrieval
from llama_index.packs.self_rag_rse.self_rag.short_form import Corrective, short_form

QUESTION = "Who wrote the while statement?"
PSEUDO_DOC = "A passage about loops."
REWRITTEN = "while statement author"
QUERY2DOC = ENGINE_PROMPTS["query2doc_prompt"].format(query_str=QUESTION)
REWRITE = ENGINE_PROMPTS["rewrite_prompt"].format(query_str=QUESTION)
GROUNDED = ENGINE_PROMPTS["grounded_prompt"].format(query_str=QUESTION)
LOOP = Corrective(
    max_retrieval_rounds=3,
    rewrite_threshold=0.5,
    support_threshold=0.5,
    utility_threshold=0.0,
    max_regenerations=1,
)


class Routes:
    """A retrieval function: the nodes listed for each search text; records what it searched."""

    def __init__(self, routes: dict[str, list[NodeWithScore]], dropped_by: str | None = None):
        self.routes = routes
        self.dropped_by = dropped_by
        self.searched: list[str] = []

    async def __call__(self, text: str) -> Retrieval:
        self.searched.append(text)
        nodes = self.routes.get(text, [])
        if self.dropped_by is None:
            return Retrieval(nodes=nodes, retrieved=len(nodes))
        note = f"{self.dropped_by} kept none of the {len(nodes)} retrieved nodes: too weak"
        return Retrieval(nodes=[], retrieved=len(nodes), dropped_by=self.dropped_by, note=note)


def score(judgement: ParagraphJudgement) -> float:
    """The default weights' final score; a failed paragraph ranks last."""
    if judgement.error is not None:
        return -math.inf
    return judgement.score()


def parts_for(critic: TableCritic, retrieve: Routes, ndocs: int | None = None) -> FlowParts:
    return FlowParts(
        critic=CheckedCritic(critic),
        retrieve=retrieve,
        score=score,
        paragraph=lambda node: node.node.get_content(),
        prompts=ENGINE_PROMPTS,
        ndocs=ndocs,
        record=QueryRecord(critic=critic.name),
    )


def routes(table: dict[str, list[str]]) -> Routes:
    return Routes({text: routed_nodes(listed) for text, listed in table.items()})


def kinds(parts: FlowParts) -> list[str]:
    return [step.kind for step in parts.record.trace]


# -- short form ----------------------------------------------------------------------------------


async def test_the_short_form_answers_from_the_best_paragraph() -> None:
    critic = TableCritic({"gold": (0.9, 0.9, 1.0), "silver": (0.8, 0.7, 0.0), "tin": (0.2, 0.1, 0)})
    parts = parts_for(critic, routes({QUESTION: ["silver", "gold", "tin"]}), ndocs=2)
    outcome = await short_form(parts, QUESTION, None)
    assert outcome.answer == "answer from gold"
    # The chosen paragraph first, then by score; ndocs cut the third before it was judged.
    assert [(s.node.node_id, s.score) for s in outcome.sources] == [
        ("gold", pytest.approx(2.3)),
        ("silver", pytest.approx(1.5)),
    ]
    record = parts.record
    assert [p.node_id for p in record.paragraphs] == ["silver", "gold"]
    assert record.best == 1 and record.retrieved is True
    assert record.trace == [Retrieve(query=QUESTION, nodes=2, round=1, retrieved=3)]
    assert critic.judged == [(QUESTION, ["silver", "gold"])]


async def test_a_failed_paragraph_is_kept_in_the_record_and_never_chosen() -> None:
    class Failing(TableCritic):
        async def ajudge(self, query: str, paragraphs: Any) -> list[ParagraphJudgement]:
            judged = await super().ajudge(query, paragraphs)
            judged[0] = ParagraphJudgement(
                answer="", relevance=0.0, support=0.0, utility=0.0, error="decode failed"
            )
            return judged

    critic = Failing({"bad": (0.9, 0.9, 1.0), "gold": (0.8, 0.8, 1.0)})
    parts = parts_for(critic, routes({QUESTION: ["bad", "gold"]}))
    outcome = await short_form(parts, QUESTION, None)
    assert outcome.answer == "answer from gold"
    failed = parts.record.paragraphs[0]
    assert failed.reported_score is None and failed.judgement.error == "decode failed"
    assert [s.score for s in outcome.sources][1] is None


@pytest.mark.parametrize(
    ("retrieve", "reason"),
    [
        (routes({}), "retriever returned no nodes"),
        (
            Routes({QUESTION: [NodeWithScore(node=TextNode(id_="blank", text=" "), score=1.0)]}),
            "every retrieved paragraph was empty",
        ),
        (
            Routes({QUESTION: routed_nodes(["gold"])}, dropped_by="DropAll"),
            "DropAll kept none of the 1 retrieved nodes: too weak",
        ),
    ],
    ids=["no_nodes", "all_empty", "dropped"],
)
async def test_nothing_to_judge_falls_back_with_the_reason(retrieve: Routes, reason: str) -> None:
    parts = parts_for(TableCritic({}), retrieve)
    outcome = await short_form(parts, QUESTION, None)
    assert outcome.answer is None and outcome.sources == []
    assert parts.record.trace[-1] == Fallback(reason=reason)
    assert parts.record.retrieved is False and parts.record.best is None
    if reason.endswith("empty"):
        assert parts.record.steps(SkipEmpty) == [SkipEmpty(node_ids=["blank"])]


async def test_no_usable_answer_falls_back() -> None:
    critic = TableCritic({"gold": (0.9, 0.9, 1.0)}, answers={"gold": "  "})
    parts = parts_for(critic, routes({QUESTION: ["gold"]}))
    outcome = await short_form(parts, QUESTION, None)
    assert outcome.answer is None
    assert parts.record.trace[-1] == Fallback(reason="no usable answer")
    assert parts.record.retrieved is True and [s.node.node_id for s in outcome.sources] == ["gold"]


# -- the corrective loop -------------------------------------------------------------------------


async def test_query2doc_when_nothing_is_relevant() -> None:
    critic = TableCritic(
        {"junk": (0.1, 0.9, 1.0), "gold": (0.9, 0.9, 1.0)}, texts={QUERY2DOC: PSEUDO_DOC}
    )
    retrieve = routes({QUESTION: ["junk"], PSEUDO_DOC: ["gold"]})
    parts = parts_for(critic, retrieve)
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from gold"
    assert retrieve.searched == [QUESTION, PSEUDO_DOC]
    assert parts.record.steps(Query2Doc) == [
        Query2Doc(reason="no relevant paragraph", query=PSEUDO_DOC)
    ]
    assert kinds(parts) == ["retrieve", "query2doc", "retrieve"]
    # Judged against the question, never the pseudo-document.
    assert [query for query, _ in critic.judged] == [QUESTION, QUESTION]


async def test_a_rewrite_after_query2doc() -> None:
    critic = TableCritic(
        {"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0), "gold": (0.9, 0.9, 1.0)},
        texts={QUERY2DOC: PSEUDO_DOC, REWRITE: REWRITTEN},
    )
    retrieve = routes({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"], REWRITTEN: ["gold"]})
    parts = parts_for(critic, retrieve)
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from gold"
    assert retrieve.searched == [QUESTION, PSEUDO_DOC, REWRITTEN]
    assert parts.record.steps(Rewrite) == [Rewrite(reason="no relevant paragraph", query=REWRITTEN)]


async def test_a_rewrite_for_low_utility() -> None:
    critic = TableCritic(
        {"meh": (0.9, 0.9, -0.5), "good": (0.9, 0.9, 1.0)}, texts={REWRITE: REWRITTEN}
    )
    retrieve = routes({QUESTION: ["meh"], REWRITTEN: ["good"]})
    parts = parts_for(critic, retrieve)
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from good"
    assert parts.record.steps(Query2Doc) == []  # a rewrite, not query2doc, for utility
    assert parts.record.steps(Rewrite) == [Rewrite(reason="low utility", query=REWRITTEN)]


async def test_an_empty_search_text_stands_for_the_question_searched_already() -> None:
    critic = TableCritic({"junk": (0.1, 0.9, 1.0)}, texts={QUERY2DOC: " ", REWRITE: ""})
    retrieve = routes({QUESTION: ["junk"]})
    parts = parts_for(critic, retrieve)
    outcome = await short_form(parts, QUESTION, LOOP)
    # Searching the question again used to judge nothing new, round after round.
    assert retrieve.searched == [QUESTION]
    assert parts.record.steps(Query2Doc) == [Query2Doc(reason="no relevant paragraph", query=" ")]
    assert parts.record.steps(Repeated) == [
        Repeated(reason="the text was searched already: the loop stops")
    ]
    assert outcome.answer is None
    assert parts.record.trace[-1] == Fallback(reason="no relevant paragraph in any round")


async def test_a_rewrite_searched_already_ends_the_rounds() -> None:
    critic = TableCritic(
        {"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0)},
        texts={QUERY2DOC: PSEUDO_DOC, REWRITE: PSEUDO_DOC},
    )
    retrieve = routes({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"]})
    parts = parts_for(critic, retrieve)
    await short_form(parts, QUESTION, LOOP)
    assert retrieve.searched == [QUESTION, PSEUDO_DOC]
    assert kinds(parts) == ["retrieve", "query2doc", "retrieve", "rewrite", "repeated", "fallback"]


async def test_a_regeneration_that_repeats_the_last_one_ends_the_regenerations() -> None:
    critic = TableCritic({"gold": (0.9, 0.1, 1.0)}, per_query={GROUNDED: {"gold": (0.9, 0.2, 1.0)}})
    parts = parts_for(critic, routes({QUESTION: ["gold"]}))
    five = dataclasses.replace(LOOP, max_regenerations=5)
    outcome = await short_form(parts, QUESTION, five)
    assert outcome.answer == "answer from gold"
    assert [query for query, _ in critic.judged].count(GROUNDED) == 2
    assert kinds(parts)[-4:] == ["regenerate", "regenerate", "repeated", "keep_best"]


async def test_a_regenerated_answer_that_is_supported_is_kept() -> None:
    critic = TableCritic({"gold": (0.9, 0.1, 1.0)}, per_query={GROUNDED: {"gold": (0.9, 0.8, 1.0)}})
    parts = parts_for(critic, routes({QUESTION: ["gold"]}))
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from gold"
    assert parts.record.steps(Regenerate) == [Regenerate(attempt=1, support=0.8, node_id="gold")]
    row = parts.record.paragraphs[0]
    assert row.judgement.support == 0.8 and row.score == pytest.approx(0.9 + 0.8 + 0.5)
    assert outcome.sources[0].score == row.score
    assert critic.judged[-1] == (GROUNDED, ["gold"])


async def test_the_next_best_supported_answer_after_failed_regenerations() -> None:
    critic = TableCritic(
        {"gold": (0.95, 0.1, 1.0), "silver": (0.8, 0.7, 0.0)},
        per_query={GROUNDED: {"gold": (0.95, 0.2, 1.0)}},
    )
    parts = parts_for(critic, routes({QUESTION: ["gold", "silver"]}))
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from silver"
    assert kinds(parts)[-2:] == ["regenerate", "next_best"]
    assert parts.record.steps(NextBest) == [NextBest(node_id="silver")]
    assert parts.record.best == 1 and outcome.sources[0].node.node_id == "silver"


async def test_the_best_answer_is_kept_when_none_is_supported() -> None:
    critic = TableCritic(
        {"gold": (0.9, 0.1, 1.0), "tin": (0.6, 0.2, 0.5)},
        per_query={GROUNDED: {"gold": (0.9, 0.2, 1.0)}},
    )
    parts = parts_for(critic, routes({QUESTION: ["gold", "tin"]}))
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer == "answer from gold"
    assert parts.record.trace[-1] == KeepBest()
    assert (
        parts.record.paragraphs[0].judgement.support == 0.1
    )  # the failed regeneration is not kept


async def test_no_relevant_paragraph_in_any_round_falls_back() -> None:
    critic = TableCritic(
        {"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0), "junk3": (0.3, 0.9, 1.0)},
        texts={QUERY2DOC: PSEUDO_DOC, REWRITE: REWRITTEN},
    )
    retrieve = routes({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"], REWRITTEN: ["junk3"]})
    parts = parts_for(critic, retrieve)
    outcome = await short_form(parts, QUESTION, LOOP)
    assert outcome.answer is None
    assert kinds(parts) == [
        "retrieve",
        "query2doc",
        "retrieve",
        "rewrite",
        "retrieve",
        "fallback",
    ]
    assert parts.record.trace[-1] == Fallback(reason="no relevant paragraph in any round")
    # Every judged paragraph is a source and a row, none chosen.
    assert parts.record.best is None and len(outcome.sources) == 3
    assert critic.generated == [QUERY2DOC, REWRITE]


async def test_the_round_limit_holds() -> None:
    critic = TableCritic({"junk": (0.1, 0.9, 1.0)})
    retrieve = routes({QUESTION: ["junk"]})
    parts = parts_for(critic, retrieve)
    one_round = Corrective(
        max_retrieval_rounds=1,
        rewrite_threshold=0.5,
        support_threshold=0.5,
        utility_threshold=0.0,
        max_regenerations=1,
    )
    outcome = await short_form(parts, QUESTION, one_round)
    assert retrieve.searched == [QUESTION] and critic.generated == []
    assert outcome.answer is None


# -- long form -----------------------------------------------------------------------------------


def segment(text: str, scores: tuple[float, float, float], stop: str) -> Continuation:
    relevance, support, utility = scores
    return Continuation(
        answer=text, relevance=relevance, support=support, utility=utility, stop=stop
    )


async def test_the_long_form_cites_each_segments_passage() -> None:
    segments = {
        ("alpha", 1): segment("Alpha one.", (0.9, 0.9, 0.5), "boundary"),
        ("beta", 1): segment("Beta one.", (0.5, 0.5, 0.0), "boundary"),
        ("beta", 2): segment("Beta two.", (0.8, 0.8, 0.5), "eos"),
        ("alpha", 2): segment("Alpha again.", (0.6, 0.6, 0.0), "eos"),
        ("gamma", 2): Continuation(
            answer="", relevance=0.0, support=0.0, utility=0.0, stop="error", error="decode failed"
        ),
    }
    critic = TableCritic({}, segments=segments)
    retrieve = routes(
        {QUESTION: ["alpha", "beta"], f"{QUESTION} Alpha one.": ["beta", "gamma", "alpha"]}
    )
    parts = parts_for(critic, retrieve)
    outcome = await long_form(
        parts,
        QUESTION,
        beam_width=2,
        max_segments=3,
        per_segment=True,
        boundary_threshold=None,
    )
    assert outcome.answer == "Alpha one. [1] Beta two. [2]"
    assert outcome.pieces == ["Alpha one. [1]", "Beta two. [2]"]
    assert [s.node.node_id for s in outcome.sources] == ["alpha", "beta"]
    record = parts.record
    assert record.retrieved is True
    assert [(s.node_id, s.citation) for s in record.segments] == [("alpha", 1), ("beta", 2)]
    assert record.path_score == pytest.approx((2.05 + 1.85) / 2)
    assert record.depth == 2
    assert record.beams[0] == [
        {"score": pytest.approx(2.05), "node_ids": ["alpha"]},
        {"score": pytest.approx(1.0), "node_ids": ["beta"]},
    ]
    assert record.steps(SegmentFailed) == [
        SegmentFailed(depth=2, path=0, node_id="gamma", error="decode failed")
    ]
    # The beta path has no passages for its follow-up search: it finishes where it is.
    assert record.steps(PathFinished) == [PathFinished(depth=2, path=1, reason="no passages")]
    last = record.steps(Depth)[-1]
    assert [(row.node_ids, row.kept, row.finished) for row in last.candidates] == [
        (["alpha", "beta"], True, True),
        (["alpha", "alpha"], True, True),
        (["beta"], False, True),
    ]
    # Depth 2 continued the alpha path from each of its three passages in one call.
    assert [len(call) for call in critic.branches] == [2, 3]


async def test_a_long_form_answer_with_no_passages_falls_back() -> None:
    parts = parts_for(TableCritic({}), routes({}))
    outcome = await long_form(
        parts,
        QUESTION,
        beam_width=2,
        max_segments=3,
        per_segment=True,
        boundary_threshold=None,
    )
    assert outcome.answer is None and outcome.sources == []
    assert parts.record.trace[-1] == Fallback(reason="no passages")
    assert parts.record.path_score is None and parts.record.segments == []


async def test_a_long_form_answer_whose_segments_have_no_text_falls_back() -> None:
    segments = {("alpha", 1): segment("", (0.9, 0.9, 0.5), "eos")}
    parts = parts_for(TableCritic({}, segments=segments), routes({QUESTION: ["alpha"]}))
    outcome = await long_form(
        parts,
        QUESTION,
        beam_width=1,
        max_segments=2,
        per_segment=False,
        boundary_threshold=None,
    )
    assert outcome.answer is None
    assert parts.record.trace[-1] == Fallback(reason="no segment has text")
    assert [s.citation for s in parts.record.segments] == [None]
