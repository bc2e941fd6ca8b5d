"""LlamaCppBackend's paragraph judgement on a tiny F32 model: reading each paragraph once for the
four questions gives the judgements of separate decodes, to 1e-5.
"""

from __future__ import annotations

import asyncio
import re
import warnings
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from llama_index.packs.self_rag_rse import CriticBackend, LlamaCppBackend
from llama_index.packs.self_rag_rse.critic.backend import (
    Generated,
    JudgementPrompts,
    ParagraphResult,
    Scored,
)
from llama_index.packs.self_rag_rse.critic.prompted_critic import _judgement
from llama_index.packs.self_rag_rse.critic.prompts import DEFAULT_PROMPTS

QUERY = "What is the capital of France?"
PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Berlin is the capital of Germany.",
    "Mount Everest is the highest mountain above sea level.",
]
PROMPTS = JudgementPrompts(
    answer=DEFAULT_PROMPTS["answer_prompt"],
    relevance=DEFAULT_PROMPTS["relevance_prompt"],
    support=DEFAULT_PROMPTS["support_prompt"],
    utility=DEFAULT_PROMPTS["utility_prompt"],
)
TOL = 1e-5


@pytest.fixture(scope="module")
def digits_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The tiny model with pieces for the utility digits ("▁1".."▁5"): the critic's label words
    must start with tokens of their own.
    """
    import llama_cpp
    import tiny_gguf

    original = tiny_gguf._tiny_vocab

    def with_digits(typing: str) -> tuple[list[str], list[float], list[int]]:
        tokens, scores, types = original(typing)
        return tokens + [f"▁{d}" for d in "12345"], scores + [0.0] * 5, types + [1] * 5

    path = tmp_path_factory.mktemp("digits") / "digits.gguf"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiny_gguf, "_tiny_vocab", with_digits)
        tiny_gguf.write_tiny_gguf(path, typing="none")
    llm = llama_cpp.Llama(
        str(Path(path)),
        n_ctx=2048,
        n_threads=1,
        n_threads_batch=1,
        type_k=0,
        type_v=0,
        verbose=False,
    )
    yield llm
    llm.close()


def judge(backend: CriticBackend, contract_default: bool = False) -> list[ParagraphResult]:
    if contract_default:  # the two rounds through generate_and_score and score
        return asyncio.run(CriticBackend.judge_paragraphs(backend, QUERY, PARAGRAPHS, PROMPTS))
    return asyncio.run(backend.judge_paragraphs(QUERY, PARAGRAPHS, PROMPTS))


def assert_same(a: list[ParagraphResult], b: list[ParagraphResult]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert isinstance(x.answer, Generated) and isinstance(y.answer, Generated)
        assert x.answer.text == y.answer.text
        assert x.answer.generated_tokens == y.answer.generated_tokens
        assert x.answer.seq_score == pytest.approx(y.answer.seq_score, abs=TOL)
        assert set(x.scores) == set(y.scores) == {"relevance", "support", "utility"}
        for name, score in x.scores.items():
            other = y.scores[name]
            assert isinstance(score, Scored) and isinstance(other, Scored)
            assert score.method == other.method == "logprobs"
            assert score.score == pytest.approx(other.score, abs=TOL)


@pytest.mark.parametrize("n_seq_max", [8, 3])
def test_one_reading_per_paragraph_gives_the_judgements_of_separate_decodes(
    digits_llm: Any, n_seq_max: int
) -> None:
    with (
        closing(LlamaCppBackend(digits_llm, max_new_tokens=12, n_seq_max=n_seq_max)) as shared,
        closing(
            LlamaCppBackend(digits_llm, max_new_tokens=12, n_seq_max=8, share_prefixes=False)
        ) as whole,
    ):
        shared.decoder.stats.reset()
        got = judge(shared)
        evaluated = shared.decoder.stats.prompt_tokens
        whole.decoder.stats.reset()
        expected = judge(whole, contract_default=True)
        separate = whole.decoder.stats.prompt_tokens
    assert_same(got, expected)
    assert all(r.answer.text for r in got if isinstance(r.answer, Generated))
    # each paragraph once instead of three times, the question and instructions shared
    assert evaluated < separate / 2


def test_the_contract_default_gives_the_same_judgements(digits_llm: Any) -> None:
    with (
        closing(LlamaCppBackend(digits_llm, max_new_tokens=12)) as backend,
        closing(LlamaCppBackend(digits_llm, max_new_tokens=12)) as other,
    ):
        assert_same(judge(backend), judge(backend, contract_default=True))
        # answers from another backend: the contract's two rounds
        mixed = asyncio.run(backend.judge_paragraphs(QUERY, PARAGRAPHS, PROMPTS, generator=other))
        assert_same(mixed, judge(backend))


def test_labels_after_a_whitespace_token_are_read_after_it(tmp_path: Path) -> None:
    """A SentencePiece vocabulary without "▁1".."▁5" (as Llama-2's and Mistral's) spells the
    utility digits "▁", "1": each is read from the logits after the prompt and "▁", to 1e-5.
    """
    import llama_cpp
    import numpy as np
    import tiny_gguf

    from llama_index.packs.self_rag_rse.critic.backend import prompt_values
    from llama_index.packs.self_rag_rse.critic.labels import UTILITY_SCALE

    path = tmp_path / "plain.gguf"
    tiny_gguf.write_tiny_gguf(path, typing="none")
    options = {"n_ctx": 2048, "n_threads": 1, "n_threads_batch": 1, "verbose": False}
    llm = llama_cpp.Llama(str(path), type_k=0, type_v=0, **options)
    with closing(LlamaCppBackend(llm, max_new_tokens=12)) as backend:
        lead, ids = backend.tokenizer.label_ids(UTILITY_SCALE)
        assert [llm.detokenize(lead)] == [b" "]
        assert [llm.detokenize(group) for group in ids] == [d.encode() for d in "12345"]
        (result,) = judge_one(backend)
        answer = result.answer
        assert isinstance(answer, Generated)
        utility = result.scores["utility"]
        assert isinstance(utility, Scored) and utility.method == "logprobs"
        values = prompt_values(QUERY, None, answer.text)
        prompt = backend.tokenizer.fitted(PROMPTS.utility, dict(values), 2)[0] + lead
    llm.close()
    raw = llama_cpp.Llama(str(path), type_k=0, type_v=0, logits_all=True, **options)
    raw.eval(prompt)
    logits = np.asarray(raw.scores[len(prompt) - 1], dtype=np.float64)
    raw.close()
    logprobs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    expected = UTILITY_SCALE.expected_value([float(logprobs[g[0]]) for g in ids])
    assert utility.score == pytest.approx(expected, abs=TOL)


def judge_one(backend: CriticBackend) -> list[ParagraphResult]:
    return asyncio.run(backend.judge_paragraphs(QUERY, PARAGRAPHS[:1], PROMPTS))


@pytest.mark.parametrize("max_new_tokens", [0, -1, 2.5])
def test_an_answer_length_below_one_is_refused(digits_llm: Any, max_new_tokens: int) -> None:
    # 0 used to give every answer as "" (the engine then said no answer could be generated,
    # for every question) and -1 failed at the first decode, both without naming the option.
    message = f"LlamaCppBackend: max_new_tokens must be an integer >= 1, got {max_new_tokens}"
    with pytest.raises(ValueError, match=message):
        LlamaCppBackend(digits_llm, max_new_tokens=max_new_tokens)


def test_a_paragraph_longer_than_the_context_is_cut_from_its_end_with_a_warning(
    digits_llm: Any,
) -> None:
    # The prompted critic over llama.cpp: a paragraph that does not fit n_ctx with the prompt and
    # the answer is shortened from its end (the instruction never is), and says so.
    with closing(LlamaCppBackend(digits_llm, n_ctx=256, max_new_tokens=8)) as backend:
        long = "Paris is the capital and largest city of France. " * 80
        cut = r"paragraph truncated from \d+ to about \d+ tokens to fit n_ctx=256"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", UserWarning)
            results = asyncio.run(backend.judge_paragraphs(QUERY, [long, PARAGRAPHS[1]], PROMPTS))
        assert any(re.search(cut, str(w.message)) for w in caught)
        for result in results:
            assert isinstance(result.answer, Generated)
            assert not any(isinstance(s, Exception) for s in result.scores.values())
        # How much was left out is in the result, as the reflection critics record it.
        assert results[0].answer.passage_cut > 100 and results[1].answer.passage_cut == 0
        rows = [_judgement(result).details for result in results]  # the paragraphs' rows
        assert rows[0]["passage_cut"] == results[0].answer.passage_cut
        assert "passage_cut" not in rows[1]
        # A query that leaves no room even without the paragraph is the query's problem: named.
        with pytest.raises(
            ValueError, match="n_ctx=256 even without the paragraph: shorten the query"
        ):
            asyncio.run(backend.judge_paragraphs("why " * 300, [long], PROMPTS))
