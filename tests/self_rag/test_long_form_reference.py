"""Sanity checks of the long-form oracle (tests/self_rag/long_form_reference.py) itself.

The oracle is what the package's long-form engine is compared with token for token, so it is
checked here against the plainest possible computations: conftest's greedy decoder and
full-vocabulary log-probs, and the score formulas written out by hand.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from models import load_llama, reference_greedy, reference_logprobs
from self_rag.long_form_reference import paragraph_text, reference_long_form

WHILE = "The while statement repeats a suite while an expression is true."
PASSAGES = [
    ("a", paragraph_text(WHILE, {"title": "while"})),
    ("b", "The for statement iterates over the items of a sequence."),
    ("c", paragraph_text("The if statement selects exactly one suite.", {"document_title": "if"})),
]
GROUNDING = ["[Fully supported]", "[Partially supported]", "[No support / Contradictory]"]
UTILITY = [f"[Utility:{k}]" for k in range(1, 6)]


class Recorder:
    """``retrieve(text)``: the three passages in an order set by a hash of ``text`` (so that
    retrieving with a segment's text changes them), every call recorded.
    """

    def __init__(self, passages: list[tuple[str, str]] | None = None) -> None:
        self.passages = PASSAGES if passages is None else passages
        self.calls: list[str] = []

    def __call__(self, text: str) -> list[tuple[str, str]]:
        self.calls.append(text)
        seed = zlib.crc32(text.encode())
        order = sorted(range(len(self.passages)), key=lambda i: (seed >> (3 * i)) & 7)
        return [self.passages[i] for i in order]


@pytest.fixture(scope="module", params=["user_defined", "control"])
def any_llm(request: pytest.FixtureRequest, long_form_ggufs: dict[str, Path]) -> Iterator[Any]:
    llm = load_llama(long_form_ggufs[request.param], logits_all=True)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def llm(long_form_ggufs: dict[str, Path]) -> Iterator[Any]:
    llm = load_llama(long_form_ggufs["user_defined"], logits_all=True)
    yield llm
    llm.close()


def tid(llm: Any, text: str) -> int:
    (token,) = llm.tokenize(text.encode(), add_bos=False, special=True)
    return token


def prompt(llm: Any, query: str) -> list[int]:
    return llm.tokenize(f"### Instruction:\n{query}\n\n### Response:\n".encode(), add_bos=True)


def evidence(llm: Any, paragraph: str) -> list[int]:
    body = llm.tokenize(paragraph.encode(), add_bos=False, special=False)
    return [tid(llm, "[Retrieval]"), tid(llm, "<paragraph>"), *body, tid(llm, "</paragraph>")]


def clean(llm: Any, tokens: list[int]) -> str:
    """Text of tokens holding no generated <paragraph> (none do in these tests)."""
    special = {tid(llm, t) for t in ["[Retrieval]", "[No Retrieval]", "[Relevant]"]}
    special |= {tid(llm, t) for t in ["[Irrelevant]", *GROUNDING, *UTILITY]}
    assert tid(llm, "<paragraph>") not in tokens
    kept = [t for t in tokens if t not in special and t != llm.token_eos()]
    return " ".join(llm.detokenize(kept).decode("utf-8", errors="ignore").split())


def cut(llm: Any, tokens: list[int], stops: set[int]) -> tuple[list[int], str | None]:
    """``tokens`` before the first of ``stops`` or EOS, and which stop it was."""
    for i, token in enumerate(tokens):
        if token == llm.token_eos():
            return tokens[:i], "eos"
        if token in stops:
            return tokens[:i], "boundary"
    return tokens, None


@pytest.mark.parametrize(
    "query,index", [("What does while do?", 0), ("What does while do?", 2), ("Explain loops.", 1)]
)
def test_one_segment_is_plain_greedy(any_llm: Any, query: str, index: int) -> None:
    """beam_width=1, max_segments=1, one passage: the greedy decode after the evidence, cut
    at [Retrieval] or EOS (covers boundary, eos and length stops).
    """
    passage = PASSAGES[index]
    result = reference_long_form(
        any_llm, query, Recorder([passage]), beam_width=1, max_segments=1, max_new_tokens=40
    )
    context = prompt(any_llm, query) + evidence(any_llm, passage[1])
    greedy = reference_greedy(any_llm, context, 40)
    tokens, stop = cut(any_llm, greedy, {tid(any_llm, "[Retrieval]")})
    (segment,) = result["segments"]
    assert segment["tokens"] == tokens
    assert segment["stop"] == (stop or "length")
    assert segment["node_id"] == passage[0]
    text = clean(any_llm, tokens)
    assert segment["text"] == text
    assert result["answer"] == (f"{text} [1]" if text else "")
    assert segment["citation"] == (1 if text else None)
    assert result["cited_node_ids"] == ([passage[0]] if text else [])
    assert result["depth"] == 1 and result["retrieve"] and result["retrieve_prob"] is None
    assert result["retrieval_queries"] == [query]
    assert result["beams"] == [[{"score": segment["score"], "node_ids": [passage[0]]}]]


def test_token_limit_versus_boundary(llm: Any) -> None:
    """A [Retrieval] generated as the max_new_tokens-th token is a boundary; one token less
    and the same tokens stop at the limit.
    """
    query, passage = "What does while do?", PASSAGES[0]
    runs = {
        n: reference_long_form(
            llm, query, Recorder([passage]), beam_width=1, max_segments=1, max_new_tokens=n
        )["segments"][0]
        for n in (40, 16, 15, 3)
    }
    assert runs[40]["stop"] == "boundary" and len(runs[40]["tokens"]) == 15
    assert runs[16]["stop"] == "boundary" and runs[16]["tokens"] == runs[40]["tokens"]
    assert runs[15]["stop"] == "length" and runs[15]["tokens"] == runs[40]["tokens"]
    assert runs[3]["stop"] == "length" and runs[3]["tokens"] == runs[40]["tokens"][:3]


def group_share(row: np.ndarray, llm: Any, members: list[str], weights: list[float]) -> float:
    p = np.array([np.exp(row[tid(llm, m)]) for m in members])
    return float(np.dot(p, weights) / p.sum())


@pytest.mark.parametrize(
    "weights", [(1.0, 1.0, 0.5, False), (0.3, 2.0, 1.5, True)], ids=["default", "seqscore"]
)
def test_scores_follow_the_formulas(llm: Any, weights: tuple[float, float, float, bool]) -> None:
    """Every segment's IsREL, IsSUP, IsUSE, seq_score and score, and the path score, from
    conftest's log-probs and the formulas written out by hand.
    """
    w_rel, w_sup, w_use, use_seqscore = weights
    query = "How do statements work?"
    retrieve = Recorder()
    result = reference_long_form(
        llm,
        query,
        retrieve,
        beam_width=2,
        max_segments=3,
        max_new_tokens=30,
        segment_retrieval="once",
        w_rel=w_rel,
        w_sup=w_sup,
        w_use=w_use,
        use_seqscore=use_seqscore,
    )
    texts = dict(retrieve(query))
    context = prompt(llm, query)
    stop_ids = {"boundary": [tid(llm, "[Retrieval]")], "eos": [llm.token_eos()], "length": []}
    grounding = {tid(llm, t) for t in GROUNDING}
    utility = {tid(llm, t) for t in UTILITY}
    assert len(result["segments"]) >= 2
    for segment in result["segments"]:
        tokens = segment["tokens"]
        generated = tokens + stop_ids[segment["stop"]]
        rows = reference_logprobs(
            llm, context + evidence(llm, texts[segment["node_id"]]), generated
        )
        rel = group_share(rows[0], llm, ["[Relevant]", "[Irrelevant]"], [1, 0])
        first_sup = next((i for i, t in enumerate(tokens) if t in grounding), None)
        first_use = next((i for i, t in enumerate(tokens) if t in utility), None)
        sup = (
            0.0 if first_sup is None else group_share(rows[first_sup], llm, GROUNDING, [1, 0.5, 0])
        )
        use = (
            0.0
            if first_use is None
            else group_share(rows[first_use], llm, UTILITY, [-1, -0.5, 0, 0.5, 1])
        )
        own = [rows[i][t] for i, t in enumerate(tokens)]
        seq = float(np.exp(np.mean(own))) if own else 0.0
        score = w_rel * rel + w_sup * sup + w_use * use + (seq if use_seqscore else 0.0)
        got = [segment[k] for k in ("relevance", "support", "utility", "seq_score", "score")]
        # conftest evaluates the segment in one batch, the oracle token by token: the F32
        # logits differ in rounding (log-probs by ~1e-8).
        assert got == pytest.approx([rel, sup, use, seq, score], abs=1e-6)
        context = context + tokens
    assert any(s["support"] > 0 for s in result["segments"])
    assert any(s["utility"] != 0 for s in result["segments"])
    scores = [s["score"] for s in result["segments"]]
    assert result["path_score"] == pytest.approx(sum(scores) / len(scores), abs=1e-12)
    assert result["beams"][-1][0]["score"] == result["path_score"]
    for beam in result["beams"]:
        assert [p["score"] for p in beam] == sorted((p["score"] for p in beam), reverse=True)
        assert len(beam) <= 2


def test_finished_paths_are_carried_over(llm: Any) -> None:
    """A path that ended at EOS stays in later beams unchanged (same score) and can win."""
    result = reference_long_form(
        llm, "What does while do?", Recorder(), beam_width=2, max_segments=3, max_new_tokens=30
    )
    assert result["depth"] == 3
    carried = 0
    for depth in range(2, result["depth"] + 1):
        for path in result["beams"][depth - 1]:
            if len(path["node_ids"]) < depth:  # finished earlier: kept as it was
                assert path in result["beams"][depth - 2]
                carried += 1
    assert carried >= 2
    assert result["beams"][-1][0]["node_ids"] == ["c"]
    (segment,) = result["segments"]
    assert segment["stop"] == "eos" and result["path_score"] == segment["score"]


def test_per_segment_retrieval(llm: Any) -> None:
    """Per segment: the query first, then the query and the path's last segment's text."""
    query = "How do statements work?"
    retrieve = Recorder()
    result = reference_long_form(
        llm, query, retrieve, beam_width=1, max_segments=3, max_new_tokens=30
    )
    segments = result["segments"]
    assert len(segments) >= 2
    expected = [query] + [f"{query} {s['text']}" for s in segments[:-1]]
    assert retrieve.calls == expected == result["retrieval_queries"]
    # Each depth's passages came from that depth's call: the segment's node is one of them.
    assert [s["node_id"] for s in segments][:1] == [retrieve(query)[0][0]]

    # A wider beam: one call per unfinished path per depth, never more than the beam.
    retrieve = Recorder()
    result = reference_long_form(
        llm, query, retrieve, beam_width=2, max_segments=3, max_new_tokens=30
    )
    assert retrieve.calls[0] == query
    assert 1 < len(retrieve.calls) <= 1 + 2 * (result["depth"] - 1)
    assert all(call.startswith(query + " ") for call in retrieve.calls[1:])


def test_once_retrieval(llm: Any) -> None:
    """Once: one call for the query; its passages serve every depth."""
    retrieve = Recorder()
    result = reference_long_form(
        llm, "Explain loops.", retrieve, beam_width=2, max_segments=3, segment_retrieval="once"
    )
    assert retrieve.calls == ["Explain loops."] == result["retrieval_queries"]
    assert result["depth"] == 3


def test_no_retrieval_boundary(llm: Any) -> None:
    """Adaptive mode with a threshold: a generated [No Retrieval] above it ends the segment at
    a boundary; always_retrieve writes past it.
    """
    query, passage = "Explain loops.", PASSAGES[0]
    runs = {
        mode: reference_long_form(
            llm,
            query,
            Recorder([passage]),
            mode=mode,
            threshold=0.0,
            beam_width=1,
            max_segments=1,
            max_new_tokens=40,
        )["segments"][0]
        for mode in ("always_retrieve", "adaptive_retrieval")
    }
    no_retrieval = tid(llm, "[No Retrieval]")
    whole = runs["always_retrieve"]["tokens"]
    assert no_retrieval in whole
    head = whole[: whole.index(no_retrieval)]
    assert runs["adaptive_retrieval"]["tokens"] == head
    assert runs["adaptive_retrieval"]["stop"] == "boundary"


def test_gate(llm: Any) -> None:
    """The adaptive gate: threshold 1 never retrieves and answers after [No Retrieval]; the
    probability is the [Retrieval] share at the first position; threshold None follows the
    greedy decode.
    """
    query = "How do statements work?"
    context = prompt(llm, query)
    row = reference_logprobs(llm, context, [0])[0]
    p = group_share(row, llm, ["[Retrieval]", "[No Retrieval]"], [1, 0])
    retrieve = Recorder()
    result = reference_long_form(
        llm, query, retrieve, mode="adaptive_retrieval", threshold=1.0, max_new_tokens=30
    )
    assert result["retrieve"] is False and retrieve.calls == [] and result["segments"] == []
    assert result["retrieve_prob"] == pytest.approx(p, abs=1e-12)
    answer = reference_greedy(llm, [*context, tid(llm, "[No Retrieval]")], 30)
    assert result["answer"] == clean(llm, answer)

    result = reference_long_form(llm, query, Recorder(), mode="adaptive_retrieval", threshold=0.0)
    assert result["retrieve"] is True and result["retrieve_prob"] == pytest.approx(p, abs=1e-12)

    decisions = []
    for query in ("How do statements work?", "What does while do?"):
        greedy = reference_greedy(llm, prompt(llm, query), 30)
        _, stop = cut(llm, greedy, {tid(llm, "[Retrieval]")})
        result = reference_long_form(
            llm, query, Recorder(), mode="adaptive_retrieval", threshold=None, max_new_tokens=30
        )
        assert result["retrieve"] is (stop == "boundary")
        decisions.append(result["retrieve"])
    assert decisions == [False, True]


def test_no_passages(llm: Any) -> None:
    """No passages: the path finishes with no segment, saying why."""
    result = reference_long_form(llm, "Explain loops.", lambda text: [], max_segments=3)
    assert result["answer"] == "" and result["segments"] == [] and result["depth"] == 1
    assert result["beams"] == [[{"score": 0.0, "node_ids": []}]]
    assert result["notes"] and result["retrieval_queries"] == ["Explain loops."]
