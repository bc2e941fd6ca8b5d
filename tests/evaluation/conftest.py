"""Fixtures for the evaluation tests: a scripted judge LLM, a word embedding, fixed engines.

The scripted LLM answers each judging prompt from a rule whose correct outcome the tests know,
so every metric's value is known in advance; it counts its calls and can fail on purpose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import pytest
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.base.response.schema import Response
from llama_index.core.bridge.pydantic import Field
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import NodeWithScore, TextNode
from scripted import ScriptedLLM

# ------------------------------------------------------------------------------------------------
# A judge LLM whose replies follow known rules.
# ------------------------------------------------------------------------------------------------


def sentences(text: str) -> list[str]:
    return [s.strip() for s in text.split(".") if s.strip()]


def contains(context: str, sentence: str) -> int:
    return int(sentence.lower() in context.lower())


#: The question a RAGAS answer-relevancy prompt regenerates from each answer.
REGENERATED = {
    "Paris is the capital of France. It has the Louvre.": "What is the capital of France?",
}


def json_objects(text: str) -> list[dict[str, Any]]:
    """The JSON objects written in ``text`` (not those nested in another), in order."""
    decoder, found, end = json.JSONDecoder(), [], 0
    for start, char in enumerate(text):
        if char == "{" and start >= end:
            try:
                value, stop = decoder.raw_decode(text, start)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
                end = stop
    return found


def ragas_reply(prompt: str) -> str:
    """RAGAS's prompts, answered by rules (see ``test_judges.py``): statements are the
    answer's sentences, a statement or sentence is supported when the context contains it.

    Read by structure, not wording: the reply's JSON schema (an object with ``properties``)
    names the task, and the last JSON object of the prompt is the input to judge.
    """
    objects = json_objects(prompt)
    title = next(o["title"] for o in objects if "properties" in o and "title" in o)
    data = objects[-1]
    if title == "StatementGeneratorOutput":
        return json.dumps({"statements": sentences(data["answer"])})
    if title == "NLIStatementOutput":
        verdicts = [
            {"statement": s, "reason": "rule", "verdict": contains(data["context"], s)}
            for s in data["statements"]
        ]
        return json.dumps({"statements": verdicts})
    if title == "ResponseRelevanceOutput":
        response = data["response"]
        question = REGENERATED.get(response, "Where do penguins live?")
        return json.dumps({"question": question, "noncommittal": int("know" in response)})
    if title == "Verification":
        first = sentences(data["answer"])[0]
        return json.dumps({"reason": "rule", "verdict": contains(data["context"], first)})
    if title == "ContextRecallClassifications":
        rows = [
            {"statement": s, "reason": "rule", "attributed": contains(data["context"], s)}
            for s in sentences(data["answer"])
        ]
        return json.dumps({"classifications": rows})
    raise AssertionError(f"unexpected RAGAS prompt {title}")


class WordEmbedding(BaseEmbedding):
    """Bag of words hashed into 64 dimensions: equal texts have cosine 1, disjoint ones 0."""

    model_name: str = "words"

    def _vector(self, text: str) -> list[float]:
        vector = [0.0] * 64
        for word in re.findall(r"\w+", text.lower()):
            vector[sum(map(ord, word)) % 64] += 1.0
        return vector

    def _get_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    async def _aget_query_embedding(self, query: str) -> list[float]:
        return self._vector(query)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._vector(text)


# ------------------------------------------------------------------------------------------------
# Engines that answer from fixed text (the runner and report are under test, not retrieval).
# ------------------------------------------------------------------------------------------------


class FixedEngine(CustomQueryEngine):
    """Answers every question with ``answers[question]`` and returns ``sources`` as nodes.

    ``sources`` are ``(document, start, end, text)``; ``llm`` (optional) is called once per
    query so model calls can be counted; ``fail_on`` questions raise.
    """

    answers: dict[str, str]
    sources: list[tuple[str, int, int, str]] = Field(default_factory=list)
    llm: Any = None
    fail_on: set[str] = Field(default_factory=set)

    def custom_query(self, query_str: str) -> Response:
        if query_str in self.fail_on:
            raise RuntimeError("engine exploded")
        if self.llm is not None:
            self.llm.complete("hello")
        nodes = [
            NodeWithScore(
                node=TextNode(
                    text=text,
                    metadata={"file_name": doc},
                    start_char_idx=start,
                    end_char_idx=end,
                ),
                score=1.0,
            )
            for doc, start, end, text in self.sources
        ]
        return Response(response=self.answers.get(query_str, ""), source_nodes=nodes)


@pytest.fixture
def scripted_llm() -> type[ScriptedLLM]:
    return ScriptedLLM


@pytest.fixture
def word_embedding() -> WordEmbedding:
    return WordEmbedding()


@pytest.fixture
def fixed_engine() -> type[FixedEngine]:
    return FixedEngine


@pytest.fixture
def ragas_rules() -> Callable[[str], str]:
    return ragas_reply
