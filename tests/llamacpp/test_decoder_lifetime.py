"""BatchedDecoder's lifetime: closing it or its Llama, also while another thread decodes, and a
llama.cpp context that cannot be created (out of memory for the KV cache).

Tests that close a model build their own ``Llama`` (the conftest ones are session-wide).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np
import pytest
from models import GGML_TYPE_F32
from models import load_llama as _llama

from llama_index.packs.self_rag_rse.llamacpp import compat
from llama_index.packs.self_rag_rse.llamacpp.compat import MODEL_CLOSED_MESSAGE, ModelClosedError
from llama_index.packs.self_rag_rse.llamacpp.context import ContextCreationError
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput

PARAGRAPHS = [
    "Paris is the capital and largest city of France.",
    "Hamlet is a tragedy written by William Shakespeare.",
    "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris.",
    "Berlin is the capital of Germany.",
    "Mount Everest is the highest mountain above sea level.",
    "x",
]
JOIN_TIMEOUT = 60.0


@pytest.fixture
def own_llm(tiny_gguf_paths: dict[str, Path]) -> Iterator[Any]:
    """A Llama this test may close."""
    llm = _llama(tiny_gguf_paths["user_defined"])
    yield llm
    llm.close()  # a second close is a no-op


def inputs_for(llm: Any, paragraphs: list[str] = PARAGRAPHS) -> dict[str, Any]:
    text = "### Instruction:\nWhat is the capital of France?\n\n### Response:\n"
    return {
        "prefix": list(llm.tokenize(text.encode(), add_bos=True)),
        "suffixes": [list(llm.tokenize(p.encode(), add_bos=False)) for p in paragraphs],
        "track_ids": [1, 2, 3],
    }


def assert_same(a: list[SequenceOutput], b: list[SequenceOutput]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.error is None and y.error is None
        assert x.tokens == y.tokens and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.token_logprobs, y.token_logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(x.tracked_logprobs, y.tracked_logprobs, atol=1e-4, rtol=0)


class PausingDecode:
    """Stands in for ``llama_cpp.llama_decode`` and counts calls: the ``pause_at``-th call signals
    ``reached`` and waits before decoding, so that another thread acts while a decode is in
    flight. It waits ``pause_s`` seconds, or until ``until()`` holds (at most JOIN_TIMEOUT).
    """

    def __init__(
        self,
        pause_at: int | None = None,
        pause_s: float = 0.3,
        until: Callable[[], bool] | None = None,
    ) -> None:
        self.real = llama_cpp.llama_decode
        self.pause_at = pause_at
        self.pause_s = pause_s
        self.until = until
        self.calls = 0
        self.reached = threading.Event()

    def __call__(self, ctx: Any, batch: Any) -> int:
        self.calls += 1
        if self.calls == self.pause_at:
            self.reached.set()
            if self.until is None:
                time.sleep(self.pause_s)
            else:
                deadline = time.monotonic() + JOIN_TIMEOUT
                while not self.until() and time.monotonic() < deadline:
                    time.sleep(0.01)
        return int(self.real(ctx, batch))


def count_decodes(monkeypatch: pytest.MonkeyPatch, job: Callable[[], Any]) -> tuple[Any, int]:
    """``job()`` and the number of ``llama_decode`` calls it made."""
    counting = PausingDecode()
    with monkeypatch.context() as patch:
        patch.setattr(llama_cpp, "llama_decode", counting)
        value = job()
    return value, counting.calls


def run_in_thread(job: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def work() -> None:
        try:
            result["value"] = job()
        except BaseException as exc:  # checked by the test
            result["error"] = exc

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread, result


# --- closing the decoder -----------------------------------------------------------------------


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified_kv", "split_kv"])
def test_close_waits_for_a_generate_running_in_another_thread(
    tiny_llm: Any, monkeypatch: pytest.MonkeyPatch, kv_unified: bool
) -> None:
    # The tiny model ends its answers after a few tokens: many paragraphs in groups of two
    # make a long call instead (dozens of llama_decode calls).
    decoder = BatchedDecoder(tiny_llm, n_seq_max=2, kv_unified=kv_unified)
    inputs = inputs_for(tiny_llm, PARAGRAPHS * 4)
    expected, total = count_decodes(
        monkeypatch, lambda: decoder.generate(**inputs, max_new_tokens=40)
    )
    decoder.close()
    pausing = PausingDecode(pause_at=total // 3)
    monkeypatch.setattr(llama_cpp, "llama_decode", pausing)
    thread, result = run_in_thread(lambda: decoder.generate(**inputs, max_new_tokens=40))
    assert pausing.reached.wait(JOIN_TIMEOUT)
    decoder.close()  # mid-way: must wait for the generate, not free its context under it
    calls_when_closed = pausing.calls
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    assert calls_when_closed == pausing.calls == total  # close returned after the last decode
    assert_same(result["value"], expected)
    assert decoder.kv_cells == 0
    # Closed but reusable: the next call creates the context again.
    assert_same(decoder.generate(**inputs, max_new_tokens=40), expected)
    decoder.close()


def test_close_inside_a_conversation_frees_at_once_and_it_recovers(tiny_llm: Any) -> None:
    decoder = BatchedDecoder(tiny_llm, n_seq_max=2)
    request = Request(inputs_for(tiny_llm)["prefix"], 8, [1, 2])
    with decoder.conversation() as conversation:
        before = conversation.run([request])
        decoder.close()  # same thread: the lock is re-entrant, so this does not deadlock
        assert decoder.kv_cells == 0
        after = conversation.run([request])  # recreates the context, re-reads the prompt
    assert_same(before, after)
    decoder.close()


# --- closing the model -------------------------------------------------------------------------


@pytest.fixture(params=["Llama.close", "LlamaModel.close", "LlamaCPP._model.close"])
def closable(
    request: pytest.FixtureRequest, tiny_gguf_paths: dict[str, Path]
) -> Iterator[tuple[Any, Callable[[], None]]]:
    """A Llama of this test's own, and one of the ways users free its model."""
    path = tiny_gguf_paths["user_defined"]
    if request.param == "LlamaCPP._model.close":
        llama_cpp_llm = pytest.importorskip("llama_index.llms.llama_cpp")
        options = {"n_threads": 1, "n_threads_batch": 1, "type_k": GGML_TYPE_F32}
        owner = llama_cpp_llm.LlamaCPP(
            model_path=str(path),
            context_window=1024,
            model_kwargs={**options, "type_v": GGML_TYPE_F32},
            verbose=False,
        )
        llm = compat.llama_of(owner)
        close = owner._model.close
    else:
        llm = _llama(path)
        # LlamaModel.close: llama-cpp-python's model wrapper, freed without Llama.close()
        close = llm.close if request.param == "Llama.close" else llm._model.close
    yield llm, close
    llm.close()


def test_use_after_the_model_was_closed_raises_model_closed_error(
    closable: tuple[Any, Callable[[], None]],
) -> None:
    own_llm, close_model = closable
    decoder = BatchedDecoder(own_llm, n_seq_max=2)
    inputs = inputs_for(own_llm)
    decoder.check_open()
    assert not decoder.closed_model
    decoder.generate(**inputs, max_new_tokens=3)  # holds a native context now
    close_model()
    with pytest.raises(ModelClosedError, match="create the engine"):
        decoder.generate(**inputs, max_new_tokens=3)  # used to crash inside llama.cpp
    with pytest.raises(ModelClosedError), decoder.conversation():
        pass
    with pytest.raises(ModelClosedError):
        decoder.is_eog(0)
    assert decoder.closed_model
    assert decoder.kv_cells == 0  # freed before the model
    with pytest.raises(ModelClosedError):
        decoder.check_open()
    decoder.close()  # still harmless
    with pytest.raises(ModelClosedError):
        BatchedDecoder(own_llm)
    assert str(ModelClosedError()) == MODEL_CLOSED_MESSAGE


def test_model_closed_inside_a_conversation_raises_in_it(own_llm: Any) -> None:
    decoder = BatchedDecoder(own_llm, n_seq_max=2)
    prefix = inputs_for(own_llm)["prefix"]
    with decoder.conversation() as conversation:
        conversation.run([Request(prefix, 3)])
        own_llm.close()  # same thread: does not wait for the conversation it is inside
        with pytest.raises(ModelClosedError):
            conversation.run([Request(prefix, 3)])
        with pytest.raises(ModelClosedError):
            conversation.run([Request(prefix, 1, [1])])


def test_model_closed_while_another_thread_decodes(
    own_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    decoder = BatchedDecoder(own_llm, n_seq_max=2)
    inputs = inputs_for(own_llm, PARAGRAPHS * 4)
    _, total = count_decodes(monkeypatch, lambda: decoder.generate(**inputs, max_new_tokens=40))
    # The decode in flight goes on once the close has begun (it then waits for that decode).
    pausing = PausingDecode(pause_at=total // 3, until=lambda: decoder.closed_model)
    monkeypatch.setattr(llama_cpp, "llama_decode", pausing)
    thread, result = run_in_thread(lambda: decoder.generate(**inputs, max_new_tokens=40))
    assert pausing.reached.wait(JOIN_TIMEOUT)
    own_llm.close()  # waits for the decode in flight; the generate stops at its next step
    thread.join(JOIN_TIMEOUT)
    assert not thread.is_alive()
    assert isinstance(result.get("error"), ModelClosedError), result
    assert pausing.calls == total // 3  # stopped at once rather than decoding for nobody
    assert decoder.kv_cells == 0
    with pytest.raises(ModelClosedError):
        decoder.generate(**inputs, max_new_tokens=3)


def test_a_model_freed_without_telling_the_decoder_is_detected_and_left_alone(
    own_llm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A llama-cpp-python without the exit stacks compat hooks: the close goes unheard.
    monkeypatch.setattr(compat, "on_close", lambda llama, callback: lambda: None)
    decoder = BatchedDecoder(own_llm, n_seq_max=2)
    inputs = inputs_for(own_llm)
    decoder.generate(**inputs, max_new_tokens=3)
    own_llm.close()
    assert decoder.kv_cells > 0  # not told
    with pytest.raises(ModelClosedError):
        decoder.generate(**inputs, max_new_tokens=3)
    decoder.close()  # leaks the context rather than letting llama_free read the freed model
    assert decoder.kv_cells == 0
    # A misuse during the program's life is a warning (only the exit of the process is quiet).
    assert [r.levelno for r in caplog.records if "leaked" in r.getMessage()] == [logging.WARNING]


def test_a_decoder_collected_with_its_llama_frees_its_context_before_the_model(
    tiny_gguf_paths: dict[str, Path],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # What every script that exits without closing does: the decoder and its Llama become
    # garbage together, and the collector clears weak references before it runs finalizers.
    llm = _llama(tiny_gguf_paths["user_defined"])
    # As in a program where the model was loaded well before the engine: the collector then
    # finalizes the model's wrapper before the decoder, which a weak reference from the
    # model's exit stack to the decoder did not survive.
    gc.collect()
    model_closed = compat.closed_check(llm)
    freed: list[bool] = []  # one entry per llama_free: whether the model was still open
    real_free = llama_cpp.llama_free

    def spy(ctx: Any) -> None:
        freed.append(not model_closed())
        real_free(ctx)

    monkeypatch.setattr(llama_cpp, "llama_free", spy)
    decoder = BatchedDecoder(llm, n_seq_max=2)
    decoder.generate(**inputs_for(llm), max_new_tokens=3)
    cycle: list[Any] = [decoder, llm]
    cycle.append(cycle)
    del decoder, llm, cycle
    gc.collect()
    assert model_closed()  # the collection did free the model
    assert freed == [True]  # and our context went first, exactly once
    assert "leaked" not in caplog.text


# --- a context that cannot be created ----------------------------------------------------------


class LimitedContexts:
    """Stands in for ``llama_cpp.llama_init_from_model``: returns NULL (None), as llama.cpp does
    when the KV cache does not fit in memory, for contexts of more than ``limit`` cells.
    """

    def __init__(self, limit: int) -> None:
        self.real = llama_cpp.llama_init_from_model
        self.limit = limit
        self.requested: list[int] = []

    def __call__(self, model: Any, params: Any) -> Any:
        self.requested.append(int(params.n_ctx))
        if params.n_ctx > self.limit:
            return None
        return self.real(model, params)


@pytest.mark.parametrize("kv_unified", [True, False], ids=["unified_kv", "split_kv"])
def test_context_creation_failure_retries_with_fewer_sequences(
    tiny_llm: Any, monkeypatch: pytest.MonkeyPatch, kv_unified: bool
) -> None:
    inputs = inputs_for(tiny_llm)
    # 100 new tokens: one sequence fits 256 cells, four (unified: their cells; split: four
    # streams) do not.
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=kv_unified) as decoder:
        expected = decoder.generate(**inputs, max_new_tokens=100)
    limited = LimitedContexts(limit=256)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", limited)
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=kv_unified) as decoder:
        outputs = decoder.generate(**inputs, max_new_tokens=100)
        assert_same(outputs, expected)  # same scores, decoded in smaller groups
        assert limited.requested[0] > 256 and limited.requested[-1] <= 256
        assert decoder.kv_cells <= 256


def test_a_size_that_failed_is_not_tried_again_for_a_while(
    tiny_llm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from llama_index.packs.self_rag_rse.llamacpp import context

    inputs = inputs_for(tiny_llm)
    limited = LimitedContexts(limit=256)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", limited)
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False) as decoder:
        first = decoder.generate(**inputs, max_new_tokens=100)
        tried = len(limited.requested)
        assert max(limited.requested) > 256
        assert caplog.text.count("at a time instead of 4") == 1
        created = decoder.stats.contexts
        second = decoder.generate(**inputs, max_new_tokens=100)
        # No failing attempt, and the context that fits (with its KV cache) was kept.
        assert limited.requested[tried:] == [] and decoder.stats.contexts == created
        assert_same(second, first)
        assert caplog.text.count("at a time instead of 4") == 1  # reported once
        monkeypatch.setattr(context, "RETRY_FAILED_SIZE_AFTER_S", 0.0)
        assert_same(decoder.generate(**inputs, max_new_tokens=100), first)
        assert max(limited.requested[tried:]) > 256  # memory may be back: the full size again


def test_context_creation_failure_for_one_sequence_raises_once(
    tiny_llm: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    inputs = inputs_for(tiny_llm)
    limited = LimitedContexts(limit=0)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", limited)
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False) as decoder:
        with pytest.raises(ContextCreationError, match=r"256 KV cells.*free memory.*n_ctx") as exc:
            decoder.generate(**inputs, max_new_tokens=100)
        assert exc.value.cells == 256 and exc.value.sequences == 1
        assert limited.requested == [1024, 512, 256]  # 4, 2 then 1 stream(s) of 256 cells
        with (
            pytest.raises(ContextCreationError, match="256 KV cells"),
            decoder.conversation() as conversation,
        ):
            conversation.run([Request(inputs["prefix"], 5)])
    monkeypatch.undo()
    with BatchedDecoder(tiny_llm, n_seq_max=4) as decoder:  # nothing sticks once memory is back
        assert decoder.generate(**inputs, max_new_tokens=5)[0].error is None


def test_a_grown_context_that_does_not_fit_falls_back_to_the_request(
    tiny_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    inputs = inputs_for(tiny_llm)
    with BatchedDecoder(tiny_llm, n_seq_max=4, kv_unified=False) as decoder:
        decoder.generate(**inputs, max_new_tokens=5)  # 4 streams of 256 cells
        limited = LimitedContexts(limit=1024)
        monkeypatch.setattr(llama_cpp, "llama_init_from_model", limited)
        with decoder.conversation() as conversation:
            # needs 512 cells for one sequence: growing the 4 streams to 768 cells (3072: a
            # quarter more, for the conversation's next call) does not fit, one stream of 512 does
            (out,) = conversation.run([Request(inputs["prefix"], 400)])
        assert out.error is None and limited.requested == [3072, 512]


def exit_callbacks(llm: Any) -> int:
    """Callbacks waiting on the exit stack that frees ``llm``'s model (llama-cpp-python's)."""
    return len(llm._model._exit_stack._exit_callbacks)


def test_decoders_dropped_on_a_shared_model_leave_nothing_on_its_exit_stack(
    own_llm: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A server that builds a decoder per request on one loaded model: each used to leave a
    # callback (holding its emptied context) on the model's exit stack until the model closed.
    model_closed = compat.closed_check(own_llm)
    freed: list[bool] = []  # one entry per llama_free: whether the model was still open
    real_free = llama_cpp.llama_free

    def spy(ctx: Any) -> None:
        freed.append(not model_closed())
        real_free(ctx)

    monkeypatch.setattr(llama_cpp, "llama_free", spy)
    kept = BatchedDecoder(own_llm, n_seq_max=2)
    kept.generate(**inputs_for(own_llm), max_new_tokens=3)
    registered = exit_callbacks(own_llm)
    for i in range(40):
        dropped = BatchedDecoder(own_llm, n_seq_max=2)
        if i % 10 == 0:
            dropped.generate(**inputs_for(own_llm), max_new_tokens=3)
        del dropped
    gc.collect()
    assert exit_callbacks(own_llm) == registered
    assert freed == [True] * 4  # each dropped decoder that made a context freed it
    # The decoder still alive is still freed before the model, once.
    own_llm.close()
    assert freed == [True] * 5
    assert kept.kv_cells == 0
    with pytest.raises(ModelClosedError):
        kept.check_open()
