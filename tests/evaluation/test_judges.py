"""The judges: LlamaIndex's evaluators and RAGAS's metrics, with a scripted judge LLM whose
replies (and so every score) are known in advance.

The RAGAS rules (tests/evaluation/conftest.py): statements are the answer's sentences; a
statement, or an answer's first sentence, is supported when the context contains it.
"""

from __future__ import annotations

import importlib.util

import pytest

from llama_index.packs.self_rag_rse.evaluation import JudgementError, make_judge
from llama_index.packs.self_rag_rse.evaluation.judges import applies, ascore, describe_judge

needs_ragas = pytest.mark.skipif(
    importlib.util.find_spec("ragas") is None, reason="ragas is not installed"
)

QUESTION = "What is the capital of France?"
ANSWER = "Paris is the capital of France. It has the Louvre."
RELEVANT = "Paris is the capital of France."
OTHER = "Berlin is in Germany."
SAMPLE = {"query": QUESTION, "response": RELEVANT, "contexts": [RELEVANT], "reference": RELEVANT}


def sample(answer, contexts=(), reference=None):
    return {
        "query": QUESTION,
        "response": answer,
        "contexts": list(contexts),
        "reference": reference,
    }


async def score(judge, metric, item):
    return await ascore(metric, judge[metric], **item)


def applicable(metric, item):
    return applies(metric, item["contexts"], item["reference"])


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
    judge = make_judge(scripted_llm(reply), word_embedding, backend="llamaindex")
    expected = {
        "li_faithfulness": 1.0,
        "li_relevancy": 0.0,
        "li_answer_relevancy": 0.5,
        "li_context_relevancy": 0.75,
        "li_correctness": 0.75,
        "li_semantic_similarity": 1.0,  # the answer is the reference
    }
    assert tuple(judge) == tuple(expected)
    for metric, value in expected.items():
        assert applicable(metric, SAMPLE)
        assert await score(judge, metric, SAMPLE) == pytest.approx(value), metric


async def test_unreadable_replies_raise(scripted_llm):
    judge = make_judge(scripted_llm(lambda prompt: "I cannot say"), backend="llamaindex")
    with pytest.raises(JudgementError, match="li_answer_relevancy"):
        await score(judge, "li_answer_relevancy", SAMPLE)
    # CorrectnessEvaluator's own parser raises on a reply without a line break.
    with pytest.raises(JudgementError, match="unreadable reply"):
        await score(judge, "li_correctness", sample(RELEVANT, reference="x"))
    two_lines = make_judge(scripted_llm(lambda prompt: "good\nI think"), backend="llamaindex")
    with pytest.raises(JudgementError, match="no score"):
        await score(two_lines, "li_correctness", sample(RELEVANT, reference="x"))


def test_applicability(scripted_llm):
    judge = make_judge(scripted_llm(reply), backend="llamaindex")
    bare = sample(RELEVANT)
    assert "li_semantic_similarity" not in judge  # no embedding model
    assert not applicable("li_faithfulness", bare)
    assert not applicable("li_correctness", bare)
    assert applicable("li_answer_relevancy", bare)
    assert applicable("a metric of yours", bare)  # unknown needs: scored on every answer


def test_make_judge_chooses_the_backend(scripted_llm, monkeypatch):
    from llama_index.packs.self_rag_rse.evaluation import judges

    llm = scripted_llm(reply)
    assert "li_faithfulness" in make_judge(llm, backend="llamaindex")

    def no_ragas(*args):
        raise ImportError("no ragas here")

    monkeypatch.setattr(judges, "_ragas_judge", no_ragas)
    assert "li_faithfulness" in make_judge(llm)  # auto falls back to core's evaluators
    with pytest.raises(ImportError, match="no ragas"):
        make_judge(llm, backend="ragas")
    with pytest.raises(ValueError, match="backend"):
        make_judge(llm, backend="deepeval")


# -- RAGAS ------------------------------------------------------------------------------------


@pytest.fixture
def judge(scripted_llm, ragas_rules, word_embedding):
    return make_judge(scripted_llm(ragas_rules), word_embedding, backend="ragas")


@needs_ragas
async def test_known_scores_with_a_reference(judge):
    item = sample(ANSWER, (RELEVANT, OTHER), reference=RELEVANT)
    # One of the answer's two statements is in the contexts.
    assert await score(judge, "faithfulness", item) == pytest.approx(0.5)
    # The regenerated question is the real one: cosine 1.
    assert await score(judge, "answer_relevancy", item) == pytest.approx(1.0)
    # The useful context ranks first: average precision 1; ranked second: 0.5.
    assert await score(judge, "context_precision", item) == pytest.approx(1.0)
    swapped = sample(ANSWER, (OTHER, RELEVANT), reference=RELEVANT)
    assert await score(judge, "context_precision", swapped) == pytest.approx(0.5)
    # The reference's one sentence is in the contexts.
    assert await score(judge, "context_recall", item) == pytest.approx(1.0)
    missing = sample(ANSWER, (OTHER,), reference=RELEVANT)
    assert await score(judge, "context_recall", missing) == pytest.approx(0.0)


@needs_ragas
async def test_without_reference_context_utilization_replaces_precision(judge):
    item = sample(ANSWER, (OTHER, RELEVANT))
    assert not applicable("context_precision", item)
    assert not applicable("context_recall", item)
    assert applicable("context_utilization", item)
    # Judged against the answer: its first sentence is in the second context.
    assert await score(judge, "context_utilization", item) == pytest.approx(0.5)
    assert not applicable("context_utilization", sample(ANSWER, (RELEVANT,), RELEVANT))


@needs_ragas
async def test_non_committal_answer_scores_zero_and_no_contexts_means_not_applicable(judge):
    vague = sample("I do not know.")
    assert await score(judge, "answer_relevancy", vague) == pytest.approx(0.0)
    assert not applicable("faithfulness", vague)


@needs_ragas
async def test_the_judge_prompts_carry_the_sample(scripted_llm, ragas_rules, word_embedding):
    llm = scripted_llm(ragas_rules)
    judge = make_judge(llm, word_embedding, backend="ragas")
    await score(judge, "faithfulness", sample(ANSWER, (RELEVANT,)))
    statements, verdicts = llm.prompts
    assert QUESTION in statements and ANSWER in statements
    assert RELEVANT in verdicts and "It has the Louvre" in verdicts


@needs_ragas
async def test_unreadable_replies_and_nan_raise(scripted_llm, word_embedding):
    garbled = make_judge(scripted_llm(lambda prompt: "no json here"), word_embedding)
    with pytest.raises(JudgementError, match="ragas faithfulness: The output parser failed"):
        await score(garbled, "faithfulness", sample(ANSWER, (RELEVANT,)))
    empty = make_judge(scripted_llm(lambda prompt: '{"statements": []}'), word_embedding)
    with pytest.raises(JudgementError, match="the judge returned nan"):
        await score(empty, "faithfulness", sample(ANSWER, (RELEVANT,)))


@needs_ragas
def test_identity_and_metrics(scripted_llm, ragas_rules, word_embedding):
    llm = scripted_llm(ragas_rules, model="judge-7b")
    judge = make_judge(llm, word_embedding, backend="ragas")
    facts = describe_judge(judge, None, llm)
    assert facts["identity"].startswith("ragas ")
    assert "ScriptedLLM(judge-7b, 256 tokens)" in facts["identity"]
    assert facts["identity"].endswith(" / ScriptedLLM(judge-7b, 256 tokens)")
    assert (
        list(judge)
        == facts["metrics"]
        == [
            "faithfulness",
            "answer_relevancy",
            "context_precision",
            "context_utilization",
            "context_recall",
        ]
    )
    assert "answer_relevancy" not in make_judge(scripted_llm(ragas_rules), backend="ragas")
    assert describe_judge(judge, "mine", llm)["identity"] == "mine"
    core = make_judge(llm, backend="llamaindex")
    described = describe_judge(core, None, llm)
    assert described["identity"].startswith("llama-index-core evaluators / ScriptedLLM(")


def test_two_ggufs_of_one_name_have_different_labels(scripted_llm, tmp_path):
    # The label keys cached answers and judgements: a second model.gguf in another folder (or
    # one re-quantised in place) was given the first one's answers, marked cached.
    from llama_index.packs.self_rag_rse.evaluation.judges import llm_label

    labels = []
    for folder, size in (("m1", 10), ("m2", 20)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "model.gguf").write_bytes(b"\0" * size)
        labels.append(
            llm_label(scripted_llm(lambda p: "", model=str(tmp_path / folder / "model.gguf")))
        )
    assert labels[0] != labels[1]
    assert labels[0].startswith("ScriptedLLM(model.gguf, 10 bytes")
