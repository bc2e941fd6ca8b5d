"""Conversations on the tiny F32 model: the KV cache carries over between calls, and results
are those of evaluating every prompt whole (``share_prefixes=False``) to 1e-5.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import pytest

from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput

PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Berlin is the capital of Germany.",
]
TOL = 1e-5


def tokens(llm: Any, text: str, bos: bool = False) -> list[int]:
    return list(llm.tokenize(text.encode(), add_bos=bos, special=False))


def assert_same(a: SequenceOutput, b: SequenceOutput) -> None:
    assert a.error is None and b.error is None
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=TOL, rtol=0)
    np.testing.assert_allclose(a.tracked_logprobs, b.tracked_logprobs, atol=TOL, rtol=0)


@pytest.fixture(params=[True, False], ids=["unified_kv", "split_kv"])
def decoders(tiny_llm: Any, request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any]]:
    """A decoder that shares and carries over, and one that evaluates every prompt whole."""
    shared = BatchedDecoder(tiny_llm, n_seq_max=8, kv_unified=request.param)
    whole = BatchedDecoder(tiny_llm, n_seq_max=8, kv_unified=request.param, share_prefixes=False)
    yield shared, whole
    shared.close()
    whole.close()


@contextmanager
def recorded(decoder: BatchedDecoder) -> Iterator[list[list[tuple[int, int]]]]:
    """Every ``llama_decode`` the decoder makes meanwhile, as ``(position, sequence)`` rows."""
    native, calls = decoder._native, []
    real = native.decode

    def recording(entries: Any) -> None:
        calls.append([(pos, seq) for _, pos, seq, _ in entries])
        real(entries)

    native.decode = recording  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        del native.decode


def rounds(llm: Any, paragraphs: list[str] = PARAGRAPHS) -> tuple[list[Request], Any]:
    """A judgement's two rounds: answers and labels, then prompts built on the answers."""
    head = tokens(llm, "Question: What is the capital of France? Paragraph:", bos=True)
    labels = [1, 2, 3]
    first = []
    for text in paragraphs:
        para = head + tokens(llm, " " + text)
        first.append(Request(para + tokens(llm, " Answer it:"), 12))
        first.append(Request(para + tokens(llm, " Relevant?"), 1, labels))

    def second(answers: list[SequenceOutput]) -> list[Request]:
        out = []
        for text, answer in zip(paragraphs, answers, strict=True):
            para = head + tokens(llm, " " + text)
            out.append(Request(para + tokens(llm, " Answer") + answer.tokens + [5], 1, labels))
            out.append(Request(head + answer.tokens + tokens(llm, " Useful?"), 1, labels))
        return out

    return first, second


def test_a_second_round_reads_only_what_is_new(decoders: tuple[Any, Any], tiny_llm: Any) -> None:
    shared, whole = decoders
    first, second = rounds(tiny_llm)
    with whole.conversation() as conversation:
        expected_first = conversation.run(first)
        expected_second = conversation.run(second(expected_first[0::2]))
    shared.stats.reset()
    with shared.conversation() as conversation:
        got_first = conversation.run(first)
        after_first = shared.stats.prompt_tokens
        got_second = conversation.run(second(got_first[0::2]))
    for a, b in zip([*got_first, *got_second], [*expected_first, *expected_second], strict=True):
        assert_same(a, b)
    # Round one: the head once, each paragraph once (for both questions), then the tails.
    asked = sum(len(r.tokens) for r in first)
    assert after_first < asked / 2
    # Round two: only what follows the paragraph (support) or the head (utility).
    new = shared.stats.prompt_tokens - after_first
    asked_second = second(got_first[0::2])
    assert new < sum(len(r.tokens) for r in asked_second) / 3
    assert shared.stats.reused_tokens > 0


def test_carry_over_continues_the_last_conversation(
    decoders: tuple[Any, Any], tiny_llm: Any
) -> None:
    shared, whole = decoders
    first, second = rounds(tiny_llm)
    with whole.conversation() as conversation:
        expected_first = conversation.run(first)
        expected_second = conversation.run(second(expected_first[0::2]))
    with shared.conversation(carry_over=True) as conversation:
        got_first = conversation.run(first)
    shared.stats.reset()
    with shared.conversation(carry_over=True) as conversation:
        got_second = conversation.run(second(got_first[0::2]))
    carried = shared.stats.prompt_tokens
    for a, b in zip([*got_first, *got_second], [*expected_first, *expected_second], strict=True):
        assert_same(a, b)
    asked = sum(len(r.tokens) for r in second(got_first[0::2]))
    assert carried < asked / 3  # the heads and paragraphs were held from the first block

    # A conversation without carry_over starts empty, and what it did is not carried either.
    with shared.conversation() as conversation:
        conversation.run(first[:1])
        assert conversation.held.keys() == {0}
    shared.stats.reset()
    with shared.conversation(carry_over=True) as conversation:
        again = conversation.run(second(got_first[0::2]))
    assert shared.stats.prompt_tokens > carried
    for a, b in zip(again, expected_second, strict=True):
        assert_same(a, b)


def test_a_kept_prompt_is_copied_and_stays_exact(decoders: tuple[Any, Any], tiny_llm: Any) -> None:
    shared, whole = decoders
    prompt = tokens(tiny_llm, "Question: Who wrote Hamlet? Answer:", bos=True)
    asks = [Request(prompt, 1, [1, 2], keep=True), Request(prompt, 8), Request([*prompt, 7], 8)]
    expected = [
        whole.generate(r.tokens, [[]], max_new_tokens=r.max_new_tokens, track_ids=r.track_ids)[0]
        for r in asks
    ]
    with shared.conversation() as conversation:
        label = conversation.run(asks[:1])[0]
        shared.stats.reset()
        free = conversation.run(asks[1:2])[0]
        assert shared.stats.prompt_tokens == 0  # held whole, with the logits after it
        forced = conversation.run(asks[2:3])[0]
        assert shared.stats.prompt_tokens == 1  # the forced token only
        again = conversation.run(asks[1:2])[0]
        assert prompt in conversation.held.values()
    assert_same(label, expected[0])
    assert_same(free, expected[1])
    assert_same(forced, expected[2])
    assert_same(again, free)


def test_little_room_evicts_and_stays_exact(tiny_llm: Any) -> None:
    first, second = rounds(tiny_llm)
    whole = BatchedDecoder(tiny_llm, n_seq_max=8, share_prefixes=False)
    with whole, whole.conversation() as conversation:
        expected = conversation.run(first)
        expected += conversation.run(second(expected[0::2]))
    for n_seq_max in (1, 3):
        small = BatchedDecoder(tiny_llm, n_seq_max=n_seq_max)
        with small, small.conversation() as conversation:
            got = conversation.run(first)
            got += conversation.run(second(got[0::2]))
            assert len(conversation.held) <= n_seq_max
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)


def test_generating_sequences_keep_consecutive_ids(tiny_llm: Any) -> None:
    # A split KV cache decodes consecutive sequence ids in one pass: when a middle sequence
    # finishes first, the last one moves into its place.
    head = tokens(tiny_llm, "Question: Which city? Paragraph:", bos=True)
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False) as decoder:
        candidates = [head + tokens(tiny_llm, f" {p} {q}") for p in PARAGRAPHS for q in "abcdefg"]
        lengths = [len(decoder.generate(c, [[]], max_new_tokens=20)[0].tokens) for c in candidates]
        long = [c for c, n in zip(candidates, lengths, strict=True) if n == 20]
        assert len(long) >= 3, lengths
        asks = [Request(long[0], 20), Request(long[1], 2), Request(long[2], 20)]
        expected = [
            decoder.generate(r.tokens, [[]], max_new_tokens=r.max_new_tokens)[0] for r in asks
        ]
        decoder.stats.reset()
        with recorded(decoder) as calls, decoder.conversation() as conversation:
            got = conversation.run(asks)
    steps = [[seq for _, seq in call] for call in calls]
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    assert [len(out.tokens) for out in got] == [20, 2, 20]
    assert decoder.stats.kv_copies >= 1
    generation = [ids for ids in steps if len(ids) <= 3][-3:]
    for ids in generation:
        assert sorted(ids) == list(range(min(ids), min(ids) + len(ids)))


def test_split_cache_batches_prompt_runs_by_depth(tiny_llm: Any) -> None:
    # Every sequence of a split-cache micro-batch attends over as many cells as the deepest
    # one, rounded up to 256: a long run is cut at 256, and a run far shallower than another
    # gets a decode of its own. The results are those of evaluating every prompt whole.
    long = tokens(tiny_llm, " ".join(PARAGRAPHS) * 6, bos=True)[:400]
    short = tokens(tiny_llm, "Question: Which city?", bos=True)
    tail = tokens(tiny_llm, " ".join(PARAGRAPHS))[:40]
    first = [Request(long, 1), Request(short, 1)]
    second = [Request(long + tail, 1), Request(short + tail, 1)]
    assert len(short) < 20 and len(tail) == 40
    whole = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False, share_prefixes=False)
    with whole, whole.conversation() as conversation:
        expected = conversation.run(first) + conversation.run(second)
    decoder = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False)
    with decoder, recorded(decoder) as entries, decoder.conversation() as conversation:
        got = conversation.run(first)
        split_at = len(entries)
        got += conversation.run(second)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    calls = [[pos for pos, _ in call] for call in entries]
    assert any(max(c) == 255 for c in calls[:split_at])  # the long prompt cut at 256
    assert all(not (min(c) < 256 <= max(c)) for c in calls[:split_at])
    assert all(max(c) - min(c) < 100 for c in calls[split_at:])  # deep and shallow apart
    assert len(calls) - split_at == 2


def test_split_cache_evaluates_runs_cut_at_256_together(tiny_llm: Any) -> None:
    # Two long prompts of the same depth: each is cut at 256, and the two cut parts fill one
    # decode of 512 rather than one decode each (a part that fits is not skipped because the
    # whole prompt would not).
    words = " ".join(PARAGRAPHS) * 6
    first = Request(tokens(tiny_llm, words, bos=True)[:400], 1)
    second = Request(tokens(tiny_llm, "Other: " + words, bos=True)[:380], 1)
    whole = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=True, share_prefixes=False)
    with whole, whole.conversation() as conversation:
        expected = conversation.run([first, second])  # no cut, no split
    decoder = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False, share_prefixes=False)
    with decoder, recorded(decoder) as calls, decoder.conversation() as conversation:
        got = conversation.run([first, second])
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    head = calls[0]
    assert len(head) == 512 and len({seq for _, seq in head}) == 2
    assert max(pos for pos, _ in head) == 255


def test_invalid_requests(tiny_llm: Any) -> None:
    with BatchedDecoder(tiny_llm, n_seq_max=2) as decoder, decoder.conversation() as conv:
        with pytest.raises(ValueError, match="at least one token"):
            conv.run([Request([], 1)])
        with pytest.raises(ValueError, match="n_ctx"):
            conv.run([Request([1], decoder.n_ctx)])
        with pytest.raises(ValueError, match="track_ids"):
            conv.run([Request([1], 1, [10**7])])
        assert conv.run([]) == []
    with pytest.raises(RuntimeError, match="closed"):
        conv.run([Request([1], 1)])


def test_split_cache_evens_out_the_prompts_last_runs(tiny_llm: Any) -> None:
    # Each paragraph's two prompts end in tails of different lengths. llama.cpp would cut
    # runs of unequal length into one micro-batch of the shorter length from every sequence
    # and a tiny one of the rest: the longer tail hands its extra tokens to the paragraph's
    # run instead, so the last prompt decode takes as many tokens from every sequence.
    first, _ = rounds(tiny_llm)
    answer, label = (len(r.tokens) - len(first[0].tokens) for r in first[:2])
    assert answer != label  # " Answer it:" and " Relevant?" differ in length
    whole = BatchedDecoder(tiny_llm, n_seq_max=8, kv_unified=False, share_prefixes=False)
    with whole, whole.conversation() as conversation:
        expected = conversation.run(first)
    decoder = BatchedDecoder(tiny_llm, n_seq_max=8, kv_unified=False)
    with decoder, recorded(decoder) as calls, decoder.conversation() as conversation:
        got = conversation.run(first)
    for a, b in zip(got, expected, strict=True):
        assert_same(a, b)
    last = next(call for call in calls if len({seq for _, seq in call}) == len(first))
    per_seq = [sum(1 for _, seq in last if seq == s) for s in {seq for _, seq in last}]
    assert len(set(per_seq)) == 1, per_seq
