"""``metadata["self_rag"]`` pinned, key for key and byte for byte, on the queries users run.

The engine builds the metadata from a typed record of what the query did; these pins hold its
keys, their order and their values exactly as users have read them. Queries on the tiny Self-RAG
GGUFs (short form, long form) take their expected values from what the critic returned during
the query (spied, so the pin holds on any machine's floating point); the corrective loop's
branches, which no real model takes on demand, are driven by a scripted critic and pinned as
literals, with the ``verbose=True`` tables they print.
"""

from __future__ import annotations

import json
from typing import Any

from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import FixedRetriever, RoutingRetriever, make_nodes
from scripted import TableCritic

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.common.notes import record_note
from llama_index.packs.self_rag_rse.critic.contract import Continuation
from llama_index.packs.self_rag_rse.critic.prompts import ENGINE_PROMPTS

QUESTION = "Who wrote the while statement?"
PSEUDO_DOC = "A passage about loops."
REWRITTEN = "while statement author"
QUERY2DOC = ENGINE_PROMPTS["query2doc_prompt"].format(query_str=QUESTION)
REWRITE = ENGINE_PROMPTS["rewrite_prompt"].format(query_str=QUESTION)
GROUNDED = ENGINE_PROMPTS["grounded_prompt"].format(query_str=QUESTION)
REAL_QUESTION = "What does the while statement do?"


def dumped(meta: dict[str, Any]) -> str:
    return json.dumps(meta, sort_keys=False)


def traced(meta: dict[str, Any]) -> str:
    """The trace lines ``verbose=True`` prints after its table, one per step."""
    return "".join(f"  trace: {entry}\n" for entry in meta["trace"])


def spy(critic: Any, method: str) -> list[Any]:
    """What ``critic.<method>`` returns from now on, call by call (the critic still answers)."""
    returned: list[Any] = []
    original = getattr(critic, method)

    async def recording(*args: Any) -> Any:
        out = await original(*args)
        returned.append(out)
        return out

    setattr(critic, method, recording)
    return returned


def paragraph_row(node_id: str, judgement: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "answer": judgement.answer,
        "relevance": judgement.relevance,
        "support": judgement.support,
        "utility": judgement.utility,
        "seq_score": judgement.seq_score,
        "score": judgement.score(),
    }


def test_a_short_form_query_on_the_tiny_model(make_engine: Any) -> None:
    blank = NodeWithScore(node=TextNode(id_="blank", text=" "), score=0.95)
    engine = make_engine(
        mode="adaptive_retrieval",
        threshold=0.0,
        retriever=FixedRetriever([blank, *make_nodes()]),
    )
    gates = spy(engine.critic, "adecide_retrieval")
    judged = spy(engine.critic, "ajudge")
    response = engine.query(REAL_QUESTION)
    (gate,) = gates
    (judgements,) = judged
    rows = [
        paragraph_row(node_id, judgement)
        for node_id, judgement in zip(["p-while", "p-for", "p-if"], judgements, strict=True)
    ]
    # The tiny model answers "" from two of the three: the one with text wins.
    assert [row["answer"] == "" for row in rows] == [True, True, False]
    expected = {
        "critic": "reflection",
        "retrieve": True,
        "retrieve_prob": gate.probability,
        "best": 2,
        "paragraphs": rows,
        "trace": [
            {"step": "decide", "retrieve": True, "probability": gate.probability},
            {"step": "retrieve", "round": 1, "query": REAL_QUESTION, "nodes": 3},
            {"step": "skip_empty", "node_ids": ["blank"], "reason": "paragraph has no text"},
        ],
    }
    assert dumped(response.metadata["self_rag"]) == dumped(expected)
    assert response.response == rows[2]["answer"]


def depth_row(rank: int, kept: bool, finished: bool, path: list[tuple[str, Any]]) -> dict[str, Any]:
    """A long-form depth table's row for a path given as (node id, segment) pairs."""
    scores = [segment.score() for _, segment in path]
    last = path[-1][1]
    return {
        "rank": rank,
        "kept": kept,
        "finished": finished,
        "path_score": sum(scores) / len(scores),
        "node_ids": [node_id for node_id, _ in path],
        "segment": last.answer,
        "relevance": last.relevance,
        "support": last.support,
        "utility": last.utility,
        "score": last.score(),
    }


def segment_row(node_id: str, citation: int, segment: Any) -> dict[str, Any]:
    return {
        "text": segment.answer,
        "node_id": node_id,
        "citation": citation,
        "relevance": segment.relevance,
        "support": segment.support,
        "utility": segment.utility,
        "seq_score": segment.seq_score,
        "score": segment.score(),
        "passage_cut": 0,
    }


def test_a_long_form_query_on_the_tiny_model(make_engine: Any, long_form_llm: Any) -> None:
    engine = make_engine(
        llm=long_form_llm,
        long_form=True,
        beam_width=2,
        max_segments=2,
        max_new_tokens=30,
        mode="adaptive_retrieval",
        threshold=0.0,
    )
    gates = spy(engine.critic, "adecide_retrieval")
    written = spy(engine.critic, "awrite_segments")
    response = engine.query(REAL_QUESTION)
    (gate,) = gates
    # Depth 1 continues the prompt from each passage; depth 2 continues the two kept paths
    # (p-for, then p-while) from each passage again.
    (while_1, for_1, if_1), (for_while, for_for, for_if, while_while, while_for, while_if) = written
    assert [s.stop for s in (while_1, for_1, if_1)] == ["boundary"] * 3
    assert while_for.stop == "eos"
    beams = [
        [
            {"score": for_1.score(), "node_ids": ["p-for"]},
            {"score": while_1.score(), "node_ids": ["p-while"]},
        ],
        [
            {"score": (for_1.score() + for_for.score()) / 2, "node_ids": ["p-for", "p-for"]},
            {"score": (for_1.score() + for_while.score()) / 2, "node_ids": ["p-for", "p-while"]},
        ],
    ]
    first = [
        depth_row(0, True, False, [("p-for", for_1)]),
        depth_row(1, True, False, [("p-while", while_1)]),
        depth_row(2, False, False, [("p-if", if_1)]),
    ]
    second = [
        depth_row(0, True, False, [("p-for", for_1), ("p-for", for_for)]),
        depth_row(1, True, False, [("p-for", for_1), ("p-while", for_while)]),
        depth_row(2, False, False, [("p-while", while_1), ("p-if", while_if)]),
        depth_row(3, False, False, [("p-for", for_1), ("p-if", for_if)]),
        depth_row(4, False, True, [("p-while", while_1), ("p-for", while_for)]),
        depth_row(5, False, False, [("p-while", while_1), ("p-while", while_while)]),
    ]
    expected = {
        "critic": "reflection",
        "retrieve": True,
        "retrieve_prob": gate.probability,
        "best": None,
        "paragraphs": [],
        "trace": [
            {"step": "decide", "retrieve": True, "probability": gate.probability},
            {"step": "retrieve", "depth": 1, "query": REAL_QUESTION, "nodes": 3},
            {"step": "depth", "depth": 1, "candidates": first},
            {
                "step": "retrieve",
                "depth": 2,
                "query": f"{REAL_QUESTION} {for_1.answer}",
                "nodes": 3,
            },
            {
                "step": "retrieve",
                "depth": 2,
                "query": f"{REAL_QUESTION} {while_1.answer}",
                "nodes": 3,
            },
            {"step": "depth", "depth": 2, "candidates": second},
        ],
        "long_form": True,
        "segments": [segment_row("p-for", 1, for_1), segment_row("p-for", 1, for_for)],
        "path_score": (for_1.score() + for_for.score()) / 2,
        "depth": 2,
        "beams": beams,
    }
    assert dumped(response.metadata["self_rag"]) == dumped(expected)
    assert response.response == f"{for_1.answer} [1] {for_for.answer} [1]"


def scripted_query(engine: SelfRAGQueryEngine, capsys: Any) -> tuple[Any, str]:
    capsys.readouterr()
    response = engine.query(QUESTION)
    return response, capsys.readouterr().out


def test_a_corrective_query_through_query2doc_rewrite_regenerate_and_next_best(
    capsys: Any,
) -> None:
    critic = TableCritic(
        {
            "junk": (0.1, 0.9, 1.0),
            "meh": (0.9, 0.1, -0.5),
            "gold": (0.95, 0.1, 1.0),
            "silver": (0.8, 0.7, 0.0),
        },
        per_query={GROUNDED: {"gold": (0.95, 0.2, 1.0)}},
        texts={QUERY2DOC: PSEUDO_DOC, REWRITE: REWRITTEN},
    )
    retriever = RoutingRetriever(
        {QUESTION: ["junk"], PSEUDO_DOC: ["meh"], REWRITTEN: ["gold", "silver"]}
    )
    engine = SelfRAGQueryEngine(retriever=retriever, critic=critic, corrective=True, verbose=True)
    response, printed = scripted_query(engine, capsys)
    assert response.response == "answer from silver"
    assert dumped(response.metadata["self_rag"]) == dumped(EXPECTED_A)
    assert printed == PRINTED_A + traced(EXPECTED_A)


def test_a_corrective_query_whose_every_round_fails(capsys: Any) -> None:
    # No relevant paragraph in any round; the rewrite is empty, so it stands for the question,
    # which was searched already: the rounds end there. The model alone writes nothing.
    critic = TableCritic(
        {"junk": (0.1, 0.9, 1.0), "junk2": (0.2, 0.9, 1.0)},
        texts={QUERY2DOC: PSEUDO_DOC, REWRITE: "", QUESTION: "  "},
    )
    retriever = RoutingRetriever({QUESTION: ["junk"], PSEUDO_DOC: ["junk2"]})
    engine = SelfRAGQueryEngine(retriever=retriever, critic=critic, corrective=True)
    response, _ = scripted_query(engine, capsys)
    assert response.response == "No answer could be generated for this question."
    assert dumped(response.metadata["self_rag"]) == dumped(EXPECTED_B)


def test_a_corrective_query_that_keeps_its_unsupported_best(capsys: Any) -> None:
    critic = TableCritic(
        {"gold": (0.9, 0.1, 1.0), "tin": (0.6, 0.2, 0.5)},
        per_query={GROUNDED: {"gold": (0.9, 0.2, 1.0)}},
    )
    retriever = RoutingRetriever({QUESTION: ["gold", "tin"]})
    engine = SelfRAGQueryEngine(
        retriever=retriever, critic=critic, corrective=True, max_regenerations=2
    )
    response, _ = scripted_query(engine, capsys)
    assert response.response == "answer from gold"
    assert dumped(response.metadata["self_rag"]) == dumped(EXPECTED_C)


class DropAll(BaseNodePostprocessor):
    """Keeps nothing and says why, as RelevantSegmentPostprocessor does."""

    def _postprocess_nodes(self, nodes: Any, query_bundle: Any = None) -> Any:
        record_note("DropAll", "best segment value 0.31 < minimum_value 0.5")
        return []


def test_a_query_whose_postprocessor_keeps_nothing(capsys: Any) -> None:
    engine = SelfRAGQueryEngine(
        retriever=RoutingRetriever({QUESTION: ["gold"]}),
        critic=TableCritic({"gold": (0.9, 0.9, 1.0)}),
        node_postprocessors=[DropAll()],
    )
    response, _ = scripted_query(engine, capsys)
    assert response.response == "model-only answer"
    assert dumped(response.metadata["self_rag"]) == dumped(EXPECTED_D)


def test_a_scripted_long_form_query(capsys: Any) -> None:
    segments = {
        ("alpha", 1): Continuation("Alpha one.", 0.9, 0.9, 0.5, stop="boundary"),
        ("beta", 1): Continuation("Beta one.", 0.5, 0.5, 0.0, stop="boundary"),
        ("beta", 2): Continuation(
            "Beta two.", 0.8, 0.8, 0.5, seq_score=0.25, stop="eos", details={"passage_cut": 3}
        ),
        ("gamma", 2): Continuation("", 0.0, 0.0, 0.0, stop="error", error="decode failed"),
    }
    retriever = RoutingRetriever(
        {QUESTION: ["alpha", "beta"], f"{QUESTION} Alpha one.": ["beta", "gamma"]}
    )
    engine = SelfRAGQueryEngine(
        retriever=retriever,
        critic=TableCritic({}, segments=segments),
        long_form=True,
        max_segments=3,
        verbose=True,
    )
    response, printed = scripted_query(engine, capsys)
    assert response.response == "Alpha one. [1] Beta two. [2]"
    assert dumped(response.metadata["self_rag"]) == dumped(EXPECTED_E)
    assert printed == PRINTED_E + traced(EXPECTED_E)


def test_a_streamed_answer_found_empty_is_traced_once_read() -> None:
    critic = TableCritic({}, texts={QUESTION: " "})
    engine = SelfRAGQueryEngine(
        retriever=RoutingRetriever({}), critic=critic, mode="no_retrieval", streaming=True
    )
    response = engine.query(QUESTION)
    before = {
        "critic": "scripted",
        "retrieve": False,
        "retrieve_prob": None,
        "best": None,
        "paragraphs": [],
        "trace": [{"step": "generate", "reason": "mode=no_retrieval"}],
    }
    assert dumped(response.metadata["self_rag"]) == dumped(before)
    assert list(response.response_gen) == ["No answer could be generated for this question."]
    after = dict(before)
    after["trace"] = [
        {"step": "generate", "reason": "mode=no_retrieval"},
        {"step": "no_answer", "reason": "the model generated no text"},
    ]
    assert dumped(response.metadata["self_rag"]) == dumped(after)


# -- the pinned literals (today's metadata and tables, as users have read them) ---------------

EXPECTED_A = {
    "critic": "scripted",
    "retrieve": True,
    "retrieve_prob": 0.9,
    "best": 3,
    "paragraphs": [
        {
            "node_id": "junk",
            "answer": "answer from junk",
            "relevance": 0.1,
            "support": 0.9,
            "utility": 1.0,
            "seq_score": None,
            "score": 1.5,
        },
        {
            "node_id": "meh",
            "answer": "answer from meh",
            "relevance": 0.9,
            "support": 0.1,
            "utility": -0.5,
            "seq_score": None,
            "score": 0.75,
        },
        {
            "node_id": "gold",
            "answer": "answer from gold",
            "relevance": 0.95,
            "support": 0.1,
            "utility": 1.0,
            "seq_score": None,
            "score": 1.55,
        },
        {
            "node_id": "silver",
            "answer": "answer from silver",
            "relevance": 0.8,
            "support": 0.7,
            "utility": 0.0,
            "seq_score": None,
            "score": 1.5,
        },
    ],
    "trace": [
        {"step": "decide", "retrieve": True, "probability": 0.9},
        {"step": "retrieve", "round": 1, "query": "Who wrote the while statement?", "nodes": 1},
        {"step": "query2doc", "reason": "no relevant paragraph", "query": "A passage about loops."},
        {"step": "retrieve", "round": 2, "query": "A passage about loops.", "nodes": 1},
        {"step": "rewrite", "reason": "low utility", "query": "while statement author"},
        {"step": "retrieve", "round": 3, "query": "while statement author", "nodes": 2},
        {"step": "regenerate", "attempt": 1, "support": 0.2, "node_id": "gold"},
        {"step": "next_best", "node_id": "silver"},
    ],
}

PRINTED_A = (
    "\n".join(
        [
            "Self-RAG [scripted] retrieve=True p=0.900",
            "   # node         rel   sup   use   seq  score  answer",
            "  0 junk        0.10  0.90 +1.00     -   1.50  answer from junk",
            "  1 meh         0.90  0.10 -0.50     -   0.75  answer from meh",
            "  2 gold        0.95  0.10 +1.00     -   1.55  answer from gold",
            "* 3 silver      0.80  0.70 +0.00     -   1.50  answer from silver",
        ]
    )
    + "\n"
)

EXPECTED_B = {
    "critic": "scripted",
    "retrieve": True,
    "retrieve_prob": 0.9,
    "best": None,
    "paragraphs": [
        {
            "node_id": "junk",
            "answer": "answer from junk",
            "relevance": 0.1,
            "support": 0.9,
            "utility": 1.0,
            "seq_score": None,
            "score": 1.5,
        },
        {
            "node_id": "junk2",
            "answer": "answer from junk2",
            "relevance": 0.2,
            "support": 0.9,
            "utility": 1.0,
            "seq_score": None,
            "score": 1.6,
        },
    ],
    "trace": [
        {"step": "decide", "retrieve": True, "probability": 0.9},
        {"step": "retrieve", "round": 1, "query": "Who wrote the while statement?", "nodes": 1},
        {"step": "query2doc", "reason": "no relevant paragraph", "query": "A passage about loops."},
        {"step": "retrieve", "round": 2, "query": "A passage about loops.", "nodes": 1},
        {"step": "rewrite", "reason": "no relevant paragraph", "query": ""},
        {"step": "repeated", "reason": "the text was searched already: the loop stops"},
        {"step": "fallback", "reason": "no relevant paragraph in any round"},
        {"step": "no_answer", "reason": "the model generated no text"},
    ],
}

EXPECTED_C = {
    "critic": "scripted",
    "retrieve": True,
    "retrieve_prob": 0.9,
    "best": 0,
    "paragraphs": [
        {
            "node_id": "gold",
            "answer": "answer from gold",
            "relevance": 0.9,
            "support": 0.1,
            "utility": 1.0,
            "seq_score": None,
            "score": 1.5,
        },
        {
            "node_id": "tin",
            "answer": "answer from tin",
            "relevance": 0.6,
            "support": 0.2,
            "utility": 0.5,
            "seq_score": None,
            "score": 1.05,
        },
    ],
    "trace": [
        {"step": "decide", "retrieve": True, "probability": 0.9},
        {"step": "retrieve", "round": 1, "query": "Who wrote the while statement?", "nodes": 2},
        {"step": "regenerate", "attempt": 1, "support": 0.2, "node_id": "gold"},
        {"step": "regenerate", "attempt": 2, "support": 0.2, "node_id": "gold"},
        {
            "step": "repeated",
            "reason": "the same answer as the attempt before: a greedy critic would write it again",
        },
        {"step": "keep_best", "reason": "no paragraph supports its answer"},
    ],
}

EXPECTED_D = {
    "critic": "scripted",
    "retrieve": False,
    "retrieve_prob": 0.9,
    "best": None,
    "paragraphs": [],
    "trace": [
        {"step": "decide", "retrieve": True, "probability": 0.9},
        {
            "step": "retrieve",
            "round": 1,
            "query": "Who wrote the while statement?",
            "nodes": 0,
            "retrieved": 1,
            "dropped_by": "DropAll",
            "reason": "DropAll kept none of the 1 retrieved nodes: best segment value 0.31 < "
            "minimum_value 0.5",
        },
        {
            "step": "fallback",
            "reason": "DropAll kept none of the 1 retrieved nodes: best segment value 0.31 < "
            "minimum_value 0.5",
        },
    ],
}

EXPECTED_E = {
    "critic": "scripted",
    "retrieve": True,
    "retrieve_prob": 0.9,
    "best": None,
    "paragraphs": [],
    "trace": [
        {"step": "decide", "retrieve": True, "probability": 0.9},
        {"step": "retrieve", "depth": 1, "query": "Who wrote the while statement?", "nodes": 2},
        {
            "step": "depth",
            "depth": 1,
            "candidates": [
                {
                    "rank": 0,
                    "kept": True,
                    "finished": False,
                    "path_score": 2.05,
                    "node_ids": ["alpha"],
                    "segment": "Alpha one.",
                    "relevance": 0.9,
                    "support": 0.9,
                    "utility": 0.5,
                    "score": 2.05,
                },
                {
                    "rank": 1,
                    "kept": True,
                    "finished": False,
                    "path_score": 1.0,
                    "node_ids": ["beta"],
                    "segment": "Beta one.",
                    "relevance": 0.5,
                    "support": 0.5,
                    "utility": 0.0,
                    "score": 1.0,
                },
            ],
        },
        {
            "step": "retrieve",
            "depth": 2,
            "query": "Who wrote the while statement? Alpha one.",
            "nodes": 2,
        },
        {
            "step": "retrieve",
            "depth": 2,
            "query": "Who wrote the while statement? Beta one.",
            "nodes": 0,
        },
        {
            "step": "segment_failed",
            "depth": 2,
            "path": 0,
            "node_id": "gamma",
            "error": "decode failed",
        },
        {"step": "path_finished", "depth": 2, "path": 1, "reason": "no passages"},
        {
            "step": "depth",
            "depth": 2,
            "candidates": [
                {
                    "rank": 0,
                    "kept": True,
                    "finished": True,
                    "path_score": 1.95,
                    "node_ids": ["alpha", "beta"],
                    "segment": "Beta two.",
                    "relevance": 0.8,
                    "support": 0.8,
                    "utility": 0.5,
                    "score": 1.85,
                },
                {
                    "rank": 1,
                    "kept": True,
                    "finished": True,
                    "path_score": 1.0,
                    "node_ids": ["beta"],
                    "segment": "Beta one.",
                    "relevance": 0.5,
                    "support": 0.5,
                    "utility": 0.0,
                    "score": 1.0,
                },
            ],
        },
    ],
    "long_form": True,
    "segments": [
        {
            "text": "Alpha one.",
            "node_id": "alpha",
            "citation": 1,
            "relevance": 0.9,
            "support": 0.9,
            "utility": 0.5,
            "seq_score": None,
            "score": 2.05,
            "passage_cut": 0,
        },
        {
            "text": "Beta two.",
            "node_id": "beta",
            "citation": 2,
            "relevance": 0.8,
            "support": 0.8,
            "utility": 0.5,
            "seq_score": 0.25,
            "score": 1.85,
            "passage_cut": 3,
        },
    ],
    "path_score": 1.95,
    "depth": 2,
    "beams": [
        [{"score": 2.05, "node_ids": ["alpha"]}, {"score": 1.0, "node_ids": ["beta"]}],
        [{"score": 1.95, "node_ids": ["alpha", "beta"]}, {"score": 1.0, "node_ids": ["beta"]}],
    ],
}

PRINTED_E = (
    "\n".join(
        [
            "Self-RAG [scripted] retrieve=True p=0.900",
            "  depth 1:",
            "    # path                       rel   sup   use    seg   path  segment",
            " *  0 alpha                     0.90  0.90 +0.50   2.05   2.05  Alpha one.",
            " *  1 beta                      0.50  0.50 +0.00   1.00   1.00  Beta one.",
            "  depth 2:",
            "    # path                       rel   sup   use    seg   path  segment",
            " *  0 alpha>beta                0.80  0.80 +0.50   1.85   1.95  Beta two. (done)",
            " *  1 beta                      0.50  0.50 +0.00   1.00   1.00  Beta one. (done)",
        ]
    )
    + "\n"
)
