"""A batched decoder and the one thread that drives it: what every llama.cpp critic holds.

Both llama.cpp critics (the reflection critic and the prompted critic's llama.cpp backend) run
blocking native decodes from async code. They do it the same way: one
:class:`~llama_index.packs.self_rag_rse.common.bridge.SerialWorker` thread per decoder, so
decodes reach llama.cpp in order and never compete for the cores, and every call holds the
decoder, so the model cannot be closed half-way through it.
"""

from __future__ import annotations

import asyncio
import codecs
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.packs.self_rag_rse.common.bridge import SerialWorker
from llama_index.packs.self_rag_rse.common.streams import Stripper, unsent_rest
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder

if TYPE_CHECKING:
    import llama_cpp

logger = logging.getLogger(__name__)

T = TypeVar("T")


class DecoderWorker:
    """A :class:`~.decoder.BatchedDecoder` over ``llm``, driven from async code by one worker
    thread named ``name``.

    ``n_seq_max`` sequences are decoded together in batches of at least 512 tokens; the other
    ``options`` (``n_ctx``, ``n_threads``, ``kv_unified``, ``share_prefixes``...) go to the decoder.
    """

    def __init__(self, llm: llama_cpp.Llama, name: str, *, n_seq_max: int, **options: Any) -> None:
        self.decoder = BatchedDecoder(
            llm, n_seq_max=n_seq_max, n_batch=max(512, n_seq_max), **options
        )
        self._worker = SerialWorker(name)

    async def run(self, func: Callable[..., T], /, *args: Any) -> T:
        """Run ``func(*args)`` on the worker thread, holding the decoder (the model is open
        throughout and ``Llama.close()`` waits for it).
        """
        return await self._worker.run(self._held, func, *args)

    async def stream(self, func: Callable[..., str], /, *args: Any) -> AsyncIterator[str]:
        """Run ``func(*args, on_text)`` on the worker thread; yield the text it reports.

        ``func`` decodes, calls ``on_text(piece)`` with each new piece of its answer (on the
        worker thread, holding the decoder; see :class:`TextStream`) and returns the whole
        answer; the pieces yielded join to it. A consumer that stops early does not stop the
        decode (llama.cpp cannot be interrupted mid-step): it finishes in the background.
        """
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()

        def on_text(piece: str) -> None:
            if piece:
                loop.call_soon_threadsafe(pieces.put_nowait, piece)

        task = asyncio.ensure_future(self.run(func, *args, on_text))
        task.add_done_callback(lambda _: pieces.put_nowait(None))
        sent: list[str] = []
        try:
            while True:
                piece = await pieces.get()
                if piece is None:  # the decode is done
                    break
                sent.append(piece)
                yield piece
            final = await task
        finally:
            if not task.done():
                task.add_done_callback(_retrieve_exception)
        if rest := unsent_rest("".join(sent), final):
            yield rest

    def _held(self, func: Callable[..., T], *args: Any) -> T:
        with self.decoder.hold():
            return func(*args)

    def close(self) -> None:
        """Wait for running work, then free the decoder's context (the model stays open)."""
        self._worker.close()
        self.decoder.close()


class TextStream:
    """The text of tokens generated one at a time, in pieces that join to exactly
    ``llama.detokenize(kept).decode("utf-8", errors="ignore").strip()`` of them all (``kept``:
    the tokens ``keep`` accepts, asked in order).

    Each token is detokenized once, on its own (llama-cpp-python detokenizes a sequence token
    by token too), through an incremental UTF-8 decoder that holds back only the bytes of an
    unfinished character; leading whitespace is dropped and trailing whitespace held until text
    follows, as the answer is stripped. A step costs one token's bytes, not the answer so far.
    """

    def __init__(self, llama: llama_cpp.Llama, keep: Callable[[int], bool]) -> None:
        self._llama = llama
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="ignore")
        self._stripper = Stripper()

    def feed(self, token: int) -> str:
        """The answer's text that ``token`` completes (often "")."""
        if not self._keep(token):
            return ""
        return self._stripper.feed(self._utf8.decode(self._llama.detokenize([token])))


def _retrieve_exception(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned decode's failure as seen (nobody is left to raise it to)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("abandoned streamed decode failed: %s", task.exception())
