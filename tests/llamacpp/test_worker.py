"""The streamed text of llama.cpp answers (``llamacpp/worker.py``): pieces that join to exactly
the non-streamed answer, each token detokenized once.
"""

from __future__ import annotations

from typing import Any

import pytest

from llama_index.packs.self_rag_rse.llamacpp.worker import TextStream

# Greek, CJK, a check mark, an accent: characters of 2 and 3 bytes, which the tiny model's
# vocabulary spells with byte tokens, one byte each.
MULTI_BYTE = "  Ωμέγα — 日本語 ✓ naïve\n "


class CountingLlama:
    """A Llama whose ``detokenize`` calls are recorded."""

    def __init__(self, llama: Any) -> None:
        self.llama = llama
        self.calls: list[list[int]] = []

    def detokenize(self, tokens: list[int]) -> bytes:
        self.calls.append(list(tokens))
        return bytes(self.llama.detokenize(tokens))


def _whole(llama: Any, tokens: list[int]) -> str:
    """The non-streamed answer, as llama-cpp-python decodes it (the independent oracle)."""
    return llama.detokenize(tokens).decode("utf-8", errors="ignore").strip()


@pytest.mark.parametrize("text", [MULTI_BYTE, "plain words, then spaces   ", " \n ", "日"])
def test_pieces_join_to_the_whole_answer(tiny_llm: Any, text: str) -> None:
    tokens = list(tiny_llm.tokenize(text.encode(), add_bos=False, special=False))
    stream = TextStream(tiny_llm, keep=lambda token: True)
    pieces = [stream.feed(token) for token in tokens]
    assert "".join(pieces) == _whole(tiny_llm, tokens) == text.strip()
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_character_split_over_tokens_arrives_whole_with_its_last_byte(tiny_llm: Any) -> None:
    tokens = list(tiny_llm.tokenize("語".encode(), add_bos=False, special=False))
    # A leading space token, then one byte token per byte: the case the stream holds back.
    assert [tiny_llm.detokenize([t]) for t in tokens[1:]] == [bytes([b]) for b in "語".encode()]
    stream = TextStream(tiny_llm, keep=lambda token: True)
    assert [stream.feed(token) for token in tokens] == ["", "", "", "語"]


def test_tokens_the_filter_drops_leave_no_text(tiny_llm: Any) -> None:
    tokens = list(tiny_llm.tokenize(MULTI_BYTE.encode(), add_bos=False, special=False))
    dropped = set(tokens[5:9])
    stream = TextStream(tiny_llm, keep=lambda token: token not in dropped)
    joined = "".join(stream.feed(token) for token in tokens)
    assert joined == _whole(tiny_llm, [t for t in tokens if t not in dropped])


def test_each_token_is_detokenized_once_on_its_own(tiny_llm: Any) -> None:
    # What keeps a step's cost flat: no step re-reads the answer so far.
    tokens = list(tiny_llm.tokenize((MULTI_BYTE * 20).encode(), add_bos=False, special=False))
    counting = CountingLlama(tiny_llm)
    stream = TextStream(counting, keep=lambda token: True)  # type: ignore[arg-type]
    for token in tokens:
        stream.feed(token)
    assert counting.calls == [[token] for token in tokens]
