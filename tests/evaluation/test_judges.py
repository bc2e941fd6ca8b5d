"""The judges: LlamaIndex's evaluators and RAGAS's metrics, with a scripted judge LLM whose
replies (and so every score) are known in advance.

The RAGAS rules (tests/evaluation/conftest.py): statements are the answer's sentences; a
statement, or an answer's first sentence, is supported when the context contains it.
"""

from __future__ import annotations

import importlib.util

import pytest

from llama_index.packs.self_rag_rse.evaluation import (
    JudgementError,
    LlamaIndexJudge,
    RagasJudge,
    Sample,
    make_judge,
)

needs_ragas = pytest.mark.skipif(
    importlib.util.find_spec("ragas") is None, reason="ragas is not installed"
)

QUESTION = "What is the capital of France?"
ANSWER = "Paris is the capital of France. It has the Louvre."
RELEVANT = "Paris is the capital of France."
OTHER = "Berlin is in Germany."
SAMPLE = Sample(QUESTION, RELEVANT, (RELEVANT,), reference=RELEVANT)

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
        await judge.ascore("li_correctness", Sample(QUESTION, RELEVANT, (), reference="x"))
    two_lines = LlamaIndexJudge(scripted_llm(lambda prompt: "good\nI think"))
    with pytest.raises(JudgementError, match="no score"):
        await two_lines.ascore("li_correctness", Sample(QUESTION, RELEVANT, (), reference="x"))


def test_applicability(scripted_llm):
    judge = LlamaIndexJudge(scripted_llm(reply))
    bare = Sample(QUESTION, RELEVANT)
    assert "li_semantic_similarity" not in judge.metric_names  # no embedding model
    assert not judge.applicable("li_faithfulness", bare)
    assert not judge.applicable("li_correctness", bare)
    assert judge.applicable("li_answer_relevancy", bare)


def test_make_judge_chooses_the_backend(scripted_llm, monkeypatch):
    from llama_index.packs.self_rag_rse.evaluation import judges

    llm = scripted_llm(reply)
    assert isinstance(make_judge(llm, backend="llamaindex"), LlamaIndexJudge)
    monkeypatch.setattr(judges, "ragas_available", lambda: False)
    assert isinstance(make_judge(llm), LlamaIndexJudge)
    with pytest.raises(ValueError, match="backend"):
        make_judge(llm, backend="deepeval")


# -- RAGAS ------------------------------------------------------------------------------------


@pytest.fixture
def judge(scripted_llm, ragas_rules, word_embedding):
    return RagasJudge(scripted_llm(ragas_rules), word_embedding)


@needs_ragas
async def test_known_scores_with_a_reference(judge):
    sample = Sample(QUESTION, ANSWER, (RELEVANT, OTHER), reference=RELEVANT)
    # One of the answer's two statements is in the contexts.
    assert await judge.ascore("faithfulness", sample) == pytest.approx(0.5)
    # The regenerated question is the real one: cosine 1.
    assert await judge.ascore("answer_relevancy", sample) == pytest.approx(1.0)
    # The useful context ranks first: average precision 1; ranked second: 0.5.
    assert await judge.ascore("context_precision", sample) == pytest.approx(1.0)
    swapped = Sample(QUESTION, ANSWER, (OTHER, RELEVANT), reference=RELEVANT)
    assert await judge.ascore("context_precision", swapped) == pytest.approx(0.5)
    # The reference's one sentence is in the contexts.
    assert await judge.ascore("context_recall", sample) == pytest.approx(1.0)
    missing = Sample(QUESTION, ANSWER, (OTHER,), reference=RELEVANT)
    assert await judge.ascore("context_recall", missing) == pytest.approx(0.0)


@needs_ragas
async def test_without_reference_context_utilization_replaces_precision(judge):
    sample = Sample(QUESTION, ANSWER, (OTHER, RELEVANT))
    assert not judge.applicable("context_precision", sample)
    assert not judge.applicable("context_recall", sample)
    assert judge.applicable("context_utilization", sample)
    # Judged against the answer: its first sentence is in the second context.
    assert await judge.ascore("context_utilization", sample) == pytest.approx(0.5)
    with_reference = Sample(QUESTION, ANSWER, (RELEVANT,), reference=RELEVANT)
    assert not judge.applicable("context_utilization", with_reference)


@needs_ragas
async def test_non_committal_answer_scores_zero_and_no_contexts_means_not_applicable(judge):
    vague = Sample(QUESTION, "I do not know.", ())
    assert await judge.ascore("answer_relevancy", vague) == pytest.approx(0.0)
    assert not judge.applicable("faithfulness", vague)


@needs_ragas
async def test_the_judge_prompts_carry_the_sample(scripted_llm, ragas_rules, word_embedding):
    llm = scripted_llm(ragas_rules)
    judge = RagasJudge(llm, word_embedding)
    await judge.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))
    statements, verdicts = llm.prompts
    assert QUESTION in statements and ANSWER in statements
    assert RELEVANT in verdicts and "It has the Louvre" in verdicts


@needs_ragas
async def test_unreadable_replies_and_nan_raise(scripted_llm, word_embedding):
    garbled = RagasJudge(scripted_llm(lambda prompt: "no json here"), word_embedding)
    with pytest.raises(JudgementError, match="ragas faithfulness: The output parser failed"):
        await garbled.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))
    empty = RagasJudge(scripted_llm(lambda prompt: '{"statements": []}'), word_embedding)
    with pytest.raises(JudgementError, match="NaN"):
        await empty.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))


@needs_ragas
def test_identity_and_metrics(scripted_llm, ragas_rules, word_embedding):
    judge = RagasJudge(scripted_llm(ragas_rules, model="judge-7b"), word_embedding)
    assert judge.identity.startswith("ragas ")
    assert "ScriptedLLM(judge-7b, 256 tokens)" in judge.identity
    assert judge.metric_names == (
        "faithfulness",
        "answer_relevancy",
        "context_precision",
        "context_utilization",
        "context_recall",
    )
    without_embeddings = RagasJudge(scripted_llm(ragas_rules))
    assert "answer_relevancy" not in without_embeddings.metric_names
    assert RagasJudge(scripted_llm(ragas_rules), name="mine").identity == "mine"
