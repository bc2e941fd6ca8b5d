"""LlamaIndex's evaluators as the judge: each evaluator's reply maps to a known score."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.evaluation import (
    JudgementError,
    LlamaIndexJudge,
    Sample,
    make_judge,
)

QUESTION = "What is the capital of France?"
ANSWER = "Paris is the capital of France."
SAMPLE = Sample(QUESTION, ANSWER, ("Paris is the capital of France.",), reference=ANSWER)

#: A distinctive phrase of each evaluator's prompt, and the reply the scripted judge gives.
REPLIES = {
    "Please tell if a given piece of information": "YES",  # faithfulness -> 1
    "in line with the context information": "NO",  # relevancy -> 0
    "if the response is relevant to the query": "Looks fine.\n[RESULT] 1",  # 1/2
    "retrieved context from the document sources": "Mostly.\n[RESULT] 3",  # 3/4
    "expert evaluation system": "4.0\nClose to the reference.",  # (4-1)/4
}


def reply(prompt: str) -> str:
    for phrase, answer in REPLIES.items():
        if phrase in prompt:
            return answer
    raise AssertionError(f"unexpected prompt: {prompt[:200]}")


async def test_known_scores(scripted_llm, word_embedding):
    judge = LlamaIndexJudge(scripted_llm(reply), word_embedding)
    expected = {
        "li_faithfulness": 1.0,
        "li_relevancy": 0.0,
        "li_answer_relevancy": 0.5,
        "li_context_relevancy": 0.75,
        "li_correctness": 0.75,
        "li_semantic_similarity": 1.0,  # the answer is the reference
    }
    assert judge.metric_names == tuple(expected)
    for metric, value in expected.items():
        assert judge.applicable(metric, SAMPLE)
        assert await judge.ascore(metric, SAMPLE) == pytest.approx(value), metric


async def test_unreadable_replies_raise(scripted_llm):
    judge = LlamaIndexJudge(scripted_llm(lambda prompt: "I cannot say"))
    with pytest.raises(JudgementError, match="li_answer_relevancy"):
        await judge.ascore("li_answer_relevancy", SAMPLE)
    # CorrectnessEvaluator's own parser raises on a reply without a line break.
    with pytest.raises(JudgementError, match="unreadable reply"):
        await judge.ascore("li_correctness", Sample(QUESTION, ANSWER, (), reference="x"))
    two_lines = LlamaIndexJudge(scripted_llm(lambda prompt: "good\nI think"))
    with pytest.raises(JudgementError, match="no score"):
        await two_lines.ascore("li_correctness", Sample(QUESTION, ANSWER, (), reference="x"))


def test_applicability(scripted_llm):
    judge = LlamaIndexJudge(scripted_llm(reply))
    bare = Sample(QUESTION, ANSWER)
    assert "li_semantic_similarity" not in judge.metric_names  # no embedding model
    assert not judge.applicable("li_faithfulness", bare)
    assert not judge.applicable("li_correctness", bare)
    assert judge.applicable("li_answer_relevancy", bare)


def test_make_judge_chooses_the_backend(scripted_llm, monkeypatch):
    from llama_index.packs.self_rag_rse.evaluation import ragas_judge

    llm = scripted_llm(reply)
    assert isinstance(make_judge(llm, backend="llamaindex"), LlamaIndexJudge)
    monkeypatch.setattr(ragas_judge, "ragas_available", lambda: False)
    assert isinstance(make_judge(llm), LlamaIndexJudge)
    with pytest.raises(ValueError, match="backend"):
        make_judge(llm, backend="deepeval")
