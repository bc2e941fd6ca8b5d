"""The batched decoder's model calls as core's LLM events: one span per sequence, the prompt
tokens evaluated for it and the tokens it generated, adding up to the decoder's own counts
whatever was shared or held; the prompted critic's llama.cpp backend reports the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.instrumentation.events.llm import (
    LLMCompletionEndEvent,
    LLMCompletionStartEvent,
)
from traces import recorded

from llama_index.packs.self_rag_rse import LlamaCppBackend, PromptedCritic
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request

PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "Berlin is the capital of Germany.",
]


def tokens(llm: Any, text: str, bos: bool = False) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=bos, special=False))


def usage(record: Any) -> list[tuple[int, int]]:
    """``(prompt tokens, completion tokens)`` of each call, in order."""
    return [
        (e.response.raw["usage"]["prompt_tokens"], e.response.raw["usage"]["completion_tokens"])
        for e in record.of(LLMCompletionEndEvent)
    ]


@pytest.mark.parametrize("unified", [True, False], ids=["unified_kv", "split_kv"])
def test_calls_count_each_prompt_token_once_where_it_was_evaluated(
    tiny_llm: Any, unified: bool
) -> None:
    decoder = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=unified)
    prefix = tokens(tiny_llm, "Question: what is the capital of France? Evidence:", bos=True)
    suffixes = [tokens(tiny_llm, f" {text}") for text in PARAGRAPHS]
    with recorded() as record:
        outputs = decoder.generate(prefix, suffixes, max_new_tokens=5)
    stats = decoder.stats
    calls = usage(record)
    assert calls == [(out.prompt_tokens, len(out.tokens)) for out in outputs]
    assert sum(p for p, _ in calls) == stats.prompt_tokens
    assert sum(c for _, c in calls) == stats.generated_tokens
    # The shared prefix counts on the first sequence that needs it, once.
    assert calls[0][0] >= len(prefix) > calls[1][0]
    starts = record.of(LLMCompletionStartEvent)
    assert [s.prompt for s in starts] == [
        tiny_llm.detokenize(prefix + suffix, special=True).decode() for suffix in suffixes
    ]
    assert len({s.span_id for s in starts}) == 3
    assert record.tree() == ["BatchedDecoder.complete"] * 3
    decoder.close()


def test_a_second_round_counts_only_what_the_cache_did_not_hold(tiny_llm: Any) -> None:
    decoder = BatchedDecoder(tiny_llm, n_seq_max=4)
    prompts = [tokens(tiny_llm, f"Evidence: {text}", bos=True) for text in PARAGRAPHS]
    with recorded() as record, decoder.conversation() as conversation:
        first = conversation.run([Request(p, max_new_tokens=3) for p in prompts])
        after = decoder.stats.prompt_tokens
        asked = tokens(tiny_llm, " Supported?")
        more = [p + out.tokens + asked for p, out in zip(prompts, first, strict=True)]
        conversation.run([Request(p, max_new_tokens=1) for p in more])
    calls = usage(record)
    second = calls[len(prompts) :]
    assert sum(p for p, _ in second) == decoder.stats.prompt_tokens - after
    assert all(p < len(prompt) for (p, _), prompt in zip(second, more, strict=True))
    assert sum(p for p, _ in calls) == decoder.stats.prompt_tokens
    decoder.close()


def test_the_prompted_critic_on_llama_cpp_reports_its_decodes(tiny_llm_plain: Any) -> None:
    backend = LlamaCppBackend(tiny_llm_plain, max_new_tokens=8, n_seq_max=8)
    with PromptedCritic(backend) as critic:
        backend.decoder.stats.reset()
        with recorded() as record:
            asyncio.run(critic.ajudge("What is the capital of France?", PARAGRAPHS))
        stats = backend.decoder.stats
        calls = usage(record)
        # Per paragraph: the answer and its relevance, then support and utility.
        assert len(calls) == 4 * len(PARAGRAPHS)
        assert sum(p for p, _ in calls) == stats.prompt_tokens
        assert sum(c for _, c in calls) == stats.generated_tokens
        spans = record.named("BatchedDecoder.complete")
        (judge,) = record.named("PromptedCritic.ajudge")
        assert {span.parent_id for span in spans} == {judge.id_}
