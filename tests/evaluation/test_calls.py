"""Counting the answering model's calls from core's LLM events: LLM requests once each, a
critic's own model calls (one per sequence decoded) apart.
"""

from __future__ import annotations

from collections.abc import Sequence

from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.llms import ChatMessage
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import (
    BaseCritic,
    ParagraphJudgement,
    RetrievalDecision,
    SelfRAGQueryEngine,
)
from llama_index.packs.self_rag_rse.evaluation.runner import ModelCallCounter

dispatcher = get_dispatcher(__name__)


class InProcessCritic(BaseCritic):
    """A critic that answers without any model, so without any LLM event."""

    name = "in-process"

    @dispatcher.span
    async def adecide_retrieval(
        self, query: str, threshold: float | None, answer_if_skipped: bool = True
    ) -> RetrievalDecision:
        return RetrievalDecision(retrieve=True, probability=0.9)

    @dispatcher.span
    async def ajudge(self, query: str, paragraphs: Sequence[str]) -> list[ParagraphJudgement]:
        return [ParagraphJudgement("an answer", 0.2, 0.9, 0.5) for _ in paragraphs]

    @dispatcher.span
    async def agenerate(self, query: str) -> str:
        return "generated"


def test_nested_llm_requests_count_once(scripted_llm):
    llm = scripted_llm(lambda prompt: "hi")
    with ModelCallCounter() as counter:
        llm.complete("a")
        # CustomLLM.chat calls its own complete: two start events, one request.
        llm.chat([ChatMessage(role="user", content="b")])
    assert counter.counts() == {"llm_requests": 2, "critic_calls": 0, "model_calls": 2}
    counter.reset()
    assert counter.counts()["model_calls"] == 0
    llm.complete("not counted: the counter is detached")
    assert counter.counts()["model_calls"] == 0


def test_an_in_process_critic_counts_one_call_per_sequence(tiny_llm):
    engine = SelfRAGQueryEngine(
        llm=tiny_llm, retriever=FixedRetriever(), mode="adaptive_retrieval", threshold=0.0
    )
    with ModelCallCounter() as counter:
        meta = engine.query("What does while do?").metadata["self_rag"]
    engine.close()
    # The gate reads one sequence, the judgement one per paragraph: each a model call, as an
    # LLM backend makes one request per prompt.
    assert meta["retrieve"] and len(meta["paragraphs"]) == 3
    assert counter.counts() == {"llm_requests": 0, "critic_calls": 4, "model_calls": 4}


def test_a_critic_that_reports_no_model_call_counts_none(scripted_llm):
    # Calls are counted from core's LLM events: a critic of your own whose model sends none
    # (the scripted one has no model) is not counted, whatever its methods' spans.
    engine = SelfRAGQueryEngine(critic=InProcessCritic(), retriever=FixedRetriever())
    with ModelCallCounter() as counter:
        engine.query("What does while do?")
    assert counter.counts() == {"llm_requests": 0, "critic_calls": 0, "model_calls": 0}


def test_a_critic_on_an_llm_is_counted_by_its_requests(scripted_llm):
    from llama_index.packs.self_rag_rse import PromptedCritic

    llm = scripted_llm(lambda prompt: "Yes")
    critic = PromptedCritic.from_llm(llm, num_workers=2)
    engine = SelfRAGQueryEngine(critic=critic, retriever=FixedRetriever())
    with ModelCallCounter() as counter:
        engine.query("What does while do?")
    counts = counter.counts()
    assert counts["critic_calls"] == 0  # every critic operation went through the LLM
    assert counts["llm_requests"] == len(llm.prompts) > 0
