"""BatchedDecoder on real llama.cpp with the tiny Self-RAG GGUF (see conftest.py)."""

from __future__ import annotations

import threading
from typing import Any

import llama_cpp
import numpy as np
import pytest

from llama_index.packs.self_rag_rse.critic.reflection import (
    NO_RETRIEVAL,
    PARAGRAPH_CLOSE,
    PARAGRAPH_OPEN,
    REFLECTION_TOKENS,
    RETRIEVAL,
)
from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput

PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "x",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Berlin is the capital of Germany.",
    "Mount Everest is the highest mountain above sea level.",
]
TOL = 1e-4


def special(llm: Any, text: str) -> int:
    (token,) = llm.tokenize(text.encode(), add_bos=False, special=True)
    return int(token)


def prompt_tokens(llm: Any, query: str = "What is the capital of France?") -> list[int]:
    text = f"### Instruction:\n{query}\n\n### Response:\n"
    return list(llm.tokenize(text.encode(), add_bos=True, special=False))


def judge_inputs(llm: Any, paragraphs: list[str] = PARAGRAPHS) -> dict[str, Any]:
    prefix = [*prompt_tokens(llm), special(llm, RETRIEVAL), special(llm, PARAGRAPH_OPEN)]
    return {
        "prefix": prefix,
        "suffixes": [list(llm.tokenize(p.encode(), add_bos=False)) for p in paragraphs],
        "suffix_tail": [special(llm, PARAGRAPH_CLOSE)],
        "track_ids": [special(llm, t) for t in REFLECTION_TOKENS],
    }


def assert_same(a: SequenceOutput, b: SequenceOutput, tol: float = TOL) -> None:
    assert a.tokens == b.tokens
    assert a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.token_logprobs, b.token_logprobs, atol=tol, rtol=0)
    np.testing.assert_allclose(a.tracked_logprobs, b.tracked_logprobs, atol=tol, rtol=0)


@pytest.fixture(scope="module", params=[True, False], ids=["unified_kv", "split_kv"])
def decoder(tiny_llm: Any, request: pytest.FixtureRequest) -> Any:
    """The decoder under test, with one shared KV cache and with one stream per sequence."""
    dec = BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=request.param)
    yield dec
    dec.close()


def test_logprobs_equal_full_vocabulary_reference(
    decoder: BatchedDecoder, tiny_llm: Any, reference_llm: Any, reference: Any
) -> None:
    inputs = judge_inputs(tiny_llm)
    outputs = decoder.generate(**inputs, max_new_tokens=30)
    assert len(outputs) == len(PARAGRAPHS)
    for suffix, out in zip(inputs["suffixes"], outputs, strict=True):
        assert out.error is None and out.tokens
        context = inputs["prefix"] + suffix + inputs["suffix_tail"]
        rows = reference(reference_llm, context, out.tokens)
        assert rows.argmax(axis=1).tolist() == out.tokens  # greedy
        np.testing.assert_allclose(out.tracked_logprobs, rows[:, inputs["track_ids"]], atol=TOL)
        chosen = rows[np.arange(len(out.tokens)), out.tokens]
        np.testing.assert_allclose(out.token_logprobs, chosen, atol=TOL)
        if out.finish_reason == "stop":
            assert decoder.is_eog(out.tokens[-1])
        else:
            assert out.finish_reason == "length" and len(out.tokens) == 30


def test_batched_equals_serial_and_chunks(decoder: BatchedDecoder, tiny_llm: Any) -> None:
    inputs = judge_inputs(tiny_llm)
    batched = decoder.generate(**inputs, max_new_tokens=30)  # 6 sequences: chunks of 4 + 2
    for i, suffix in enumerate(inputs["suffixes"]):
        (serial,) = decoder.generate(**{**inputs, "suffixes": [suffix]}, max_new_tokens=30)
        assert_same(batched[i], serial)


def test_stop_ids_max_new_tokens_and_empty_suffix(decoder: BatchedDecoder, tiny_llm: Any) -> None:
    inputs = judge_inputs(tiny_llm)
    full = decoder.generate(**inputs, max_new_tokens=30)
    short = decoder.generate(**inputs, max_new_tokens=2)
    for a, b in zip(full, short, strict=True):
        assert b.tokens == a.tokens[:2]
        assert b.finish_reason == ("length" if len(a.tokens) > 2 else a.finish_reason)
    stop = full[0].tokens[1]
    (stopped,) = decoder.generate(
        **{**inputs, "suffixes": inputs["suffixes"][:1]}, max_new_tokens=30, stop_ids=[stop]
    )
    assert stopped.tokens == full[0].tokens[:2] and stopped.finish_reason == "stop"
    assert decoder.generate(**inputs, max_new_tokens=0)[0].tokens == []
    # an empty suffix continues straight from the prefix
    (bare,) = decoder.generate(inputs["prefix"], [[]], max_new_tokens=5)
    with decoder.conversation() as conversation:
        assert bare.tokens == conversation.run([Request(inputs["prefix"], 5)])[0].tokens


def test_conversation_reads_first_position_then_continues(
    decoder: BatchedDecoder, tiny_llm: Any, reference_llm: Any, reference: Any
) -> None:
    prompt = prompt_tokens(tiny_llm)
    track = [special(tiny_llm, t) for t in REFLECTION_TOKENS]
    no_retrieval = special(tiny_llm, NO_RETRIEVAL)
    with decoder.conversation() as conversation:
        (first,) = conversation.run([Request(prompt, 1, track, keep=True)])
        (free,) = conversation.run([Request(prompt, 20, track)])
        (forced,) = conversation.run([Request([*prompt, no_retrieval], 20, track)])
        (again,) = conversation.run([Request(prompt, 20, track)])  # from the bare prompt again
    assert_same(free, again)
    np.testing.assert_allclose(free.tracked_logprobs[0], first.tracked_logprobs[0], atol=1e-9)
    expected = reference(reference_llm, prompt, [0])[0, track]
    np.testing.assert_allclose(first.tracked_logprobs[0], expected, atol=TOL)
    rows = reference(reference_llm, [*prompt, no_retrieval], forced.tokens)
    assert rows.argmax(axis=1).tolist() == forced.tokens
    np.testing.assert_allclose(forced.tracked_logprobs, rows[:, track], atol=TOL)


def test_conversation_survives_a_nested_generate(decoder: BatchedDecoder, tiny_llm: Any) -> None:
    inputs = judge_inputs(tiny_llm)
    request = Request(prompt_tokens(tiny_llm), 10)
    with decoder.conversation() as conversation:
        (before,) = conversation.run([request])
        decoder.generate(**inputs, max_new_tokens=5)  # same thread: re-entrant, wipes the cache
        (after,) = conversation.run([request])  # notices and re-reads its prompt
    assert_same(before, after)
    with pytest.raises(RuntimeError, match="closed"):
        conversation.run([request])


def test_long_suffix_is_truncated_with_a_warning(tiny_llm: Any, caplog: Any) -> None:
    inputs = judge_inputs(tiny_llm)
    prefix_len = len(inputs["prefix"])
    n_ctx, max_new = prefix_len + 40, 10
    long_suffix = list(tiny_llm.tokenize(b" ".join([b"lorem ipsum dolor"] * 20), add_bos=False))
    budget = n_ctx - prefix_len - 1 - max_new
    assert len(long_suffix) > budget
    with BatchedDecoder(tiny_llm, n_seq_max=2, n_ctx=n_ctx) as small:
        with pytest.warns(UserWarning, match="truncated"):
            out, short = small.generate(
                **{**inputs, "suffixes": [long_suffix, inputs["suffixes"][0]]},
                max_new_tokens=max_new,
            )
        assert "truncated" in caplog.text
        assert out.truncated == len(long_suffix) - budget and short.truncated == 0
        (expected,) = small.generate(
            **{**inputs, "suffixes": [long_suffix[:budget]]}, max_new_tokens=max_new
        )
        assert_same(out, expected)  # the tail (</paragraph>) survived, the prefix too
        with pytest.raises(ValueError, match="n_ctx"):
            small.generate(**inputs, max_new_tokens=n_ctx)


def test_failing_sequence_does_not_lose_the_others(
    decoder: BatchedDecoder, tiny_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = judge_inputs(tiny_llm)
    poison_id = 4  # the byte token <0x01>: never chosen by the tiny model's greedy decoding
    assert tiny_llm.detokenize([poison_id]) == b"\x01"
    expected = decoder.generate(**inputs, max_new_tokens=30)
    assert all(poison_id not in out.tokens for out in expected)
    real_decode = llama_cpp.llama_decode
    calls = {"failed": 0}

    def flaky_decode(ctx: Any, batch: Any) -> int:
        if any(batch.token[i] == poison_id for i in range(batch.n_tokens)):
            calls["failed"] += 1
            return -1
        return int(real_decode(ctx, batch))

    monkeypatch.setattr(llama_cpp, "llama_decode", flaky_decode)
    suffixes = [list(s) for s in inputs["suffixes"]]
    suffixes[1] = suffixes[1] + [poison_id]
    outputs = decoder.generate(**{**inputs, "suffixes": suffixes}, max_new_tokens=30)
    assert calls["failed"] >= 2  # failed in its group, then alone
    assert outputs[1].finish_reason == "error" and "llama_decode returned -1" in str(
        outputs[1].error
    )
    for i, out in enumerate(outputs):
        if i != 1:
            assert out.error is None
            assert_same(out, expected[i])


def test_concurrent_calls_are_serialised(decoder: BatchedDecoder, tiny_llm: Any) -> None:
    inputs = judge_inputs(tiny_llm)
    jobs = [inputs["suffixes"][i : i + 3] for i in range(4)]
    expected = [decoder.generate(**{**inputs, "suffixes": s}, max_new_tokens=20) for s in jobs]
    results: dict[int, list[SequenceOutput]] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(3):
                results[i] = decoder.generate(**{**inputs, "suffixes": jobs[i]}, max_new_tokens=20)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    for i, outs in enumerate(expected):
        for a, b in zip(outs, results[i], strict=True):
            assert_same(a, b)


def test_context_is_kept_grown_and_freed(tiny_gguf_paths: dict[str, Any]) -> None:
    llm = llama_cpp.Llama(
        str(tiny_gguf_paths["user_defined"]),
        n_ctx=1024,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
    )
    decoder = BatchedDecoder(llm, n_seq_max=2)
    inputs = judge_inputs(llm)
    decoder.generate(**{**inputs, "suffixes": inputs["suffixes"][:1]}, max_new_tokens=5)
    cells, created = decoder.kv_cells, decoder.stats.contexts
    assert cells > 0 and created == 1
    decoder.generate(**{**inputs, "suffixes": inputs["suffixes"][:1]}, max_new_tokens=5)
    assert decoder.stats.contexts == created  # reused
    decoder.generate(**inputs, max_new_tokens=400)
    assert decoder.kv_cells > cells and decoder.stats.contexts == created + 1  # grown
    llm.close()  # closing the Llama frees our context first
    assert decoder.kv_cells == 0


def test_flash_attention_is_opt_in_and_close(
    tiny_llm: Any, reference_llm: Any, reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # llama.cpp's CPU flash-attention kernel computes in F16: close to, not equal to, the
    # reference. It is off unless asked for (or the Llama has it on; this one has it off).
    off, on = llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED, llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    assert compat.context_params(tiny_llm).flash_attn_type == off
    asked: list[int] = []  # the flash_attn_type of every context llama.cpp was asked for
    real_init = llama_cpp.llama_init_from_model

    def recording_init(model: Any, params: Any) -> Any:
        asked.append(params.flash_attn_type)
        return real_init(model, params)

    monkeypatch.setattr(llama_cpp, "llama_init_from_model", recording_init)
    inputs = judge_inputs(tiny_llm)
    runs = {}
    for flash_attn in (None, True):
        with BatchedDecoder(tiny_llm, n_seq_max=4, flash_attn=flash_attn) as decoder:
            runs[flash_attn] = decoder.generate(**inputs, max_new_tokens=20)
    assert asked == [off, on]
    largest: dict[bool | None, float] = {}
    for flash_attn, outputs in runs.items():
        for suffix, out in zip(inputs["suffixes"], outputs, strict=True):
            context = inputs["prefix"] + suffix + inputs["suffix_tail"]
            rows = reference(reference_llm, context, out.tokens)[:, inputs["track_ids"]]
            np.testing.assert_allclose(out.tracked_logprobs, rows, atol=0.05)
            gap = float(np.max(np.abs(out.tracked_logprobs - rows)))
            largest[flash_attn] = max(largest.get(flash_attn, 0.0), gap)
    # Off: the reference's kernel, equal up to rounding; on: the F16 kernel's error shows.
    assert largest[None] < TOL < largest[True]


def test_kv_layout_follows_the_attention_kernel(tiny_llm: Any) -> None:
    # CPU without flash attention: one stream per sequence (no masked attention work);
    # with flash attention (masked cells skipped) or GPU offload: one shared cache.
    offloaded = tiny_llm.model_params.n_gpu_layers != 0 and llama_cpp.llama_supports_gpu_offload()
    with BatchedDecoder(tiny_llm) as default:
        assert default.kv_unified is offloaded
    with BatchedDecoder(tiny_llm, flash_attn=True) as flash:
        assert flash.kv_unified is True
    with BatchedDecoder(tiny_llm, kv_unified=True, flash_attn=False) as unified:
        assert unified.kv_unified is True
    with BatchedDecoder(tiny_llm, kv_unified=False, flash_attn=True) as split:
        assert split.kv_unified is False


def test_invalid_arguments(decoder: BatchedDecoder, tiny_llm: Any) -> None:
    with pytest.raises(ValueError, match="prefix"):
        decoder.generate([], [[1]], max_new_tokens=1)
    with pytest.raises(ValueError, match="track_ids"):
        decoder.generate([1], [[]], max_new_tokens=1, track_ids=[10**7])
    with pytest.raises(ValueError, match="n_seq_max"):
        BatchedDecoder(tiny_llm, n_seq_max=0)
    assert decoder.generate([1], [], max_new_tokens=3) == []
