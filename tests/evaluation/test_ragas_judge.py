"""RAGAS metrics through its LlamaIndex wrappers, with a scripted judge whose outcome is known.

The judge's rules (tests/evaluation/conftest.py): statements are the answer's sentences; a
statement, or an answer's first sentence, is supported when the context contains it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("ragas")

from llama_index.packs.self_rag_rse.evaluation import JudgementError, RagasJudge, Sample

QUESTION = "What is the capital of France?"
ANSWER = "Paris is the capital of France. It has the Louvre."
RELEVANT = "Paris is the capital of France."
OTHER = "Berlin is in Germany."


@pytest.fixture
def judge(scripted_llm, ragas_rules, word_embedding):
    return RagasJudge(scripted_llm(ragas_rules), word_embedding)


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


async def test_without_reference_context_utilization_replaces_precision(judge):
    sample = Sample(QUESTION, ANSWER, (OTHER, RELEVANT))
    assert not judge.applicable("context_precision", sample)
    assert not judge.applicable("context_recall", sample)
    assert judge.applicable("context_utilization", sample)
    # Judged against the answer: its first sentence is in the second context.
    assert await judge.ascore("context_utilization", sample) == pytest.approx(0.5)
    with_reference = Sample(QUESTION, ANSWER, (RELEVANT,), reference=RELEVANT)
    assert not judge.applicable("context_utilization", with_reference)


async def test_non_committal_answer_scores_zero_and_no_contexts_means_not_applicable(judge):
    vague = Sample(QUESTION, "I do not know.", ())
    assert await judge.ascore("answer_relevancy", vague) == pytest.approx(0.0)
    assert not judge.applicable("faithfulness", vague)


async def test_the_judge_prompts_carry_the_sample(scripted_llm, ragas_rules, word_embedding):
    llm = scripted_llm(ragas_rules)
    judge = RagasJudge(llm, word_embedding)
    await judge.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))
    statements, verdicts = llm.prompts
    assert QUESTION in statements and ANSWER in statements
    assert RELEVANT in verdicts and "It has the Louvre" in verdicts


async def test_unreadable_replies_and_nan_raise(scripted_llm, word_embedding):
    garbled = RagasJudge(scripted_llm(lambda prompt: "no json here"), word_embedding)
    with pytest.raises(JudgementError, match="ragas faithfulness: The output parser failed"):
        await garbled.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))
    empty = RagasJudge(scripted_llm(lambda prompt: '{"statements": []}'), word_embedding)
    with pytest.raises(JudgementError, match="NaN"):
        await empty.ascore("faithfulness", Sample(QUESTION, ANSWER, (RELEVANT,)))


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
