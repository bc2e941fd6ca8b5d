"""A batched decoder and the one thread that drives it: what every llama.cpp critic holds.

Both llama.cpp critics (the reflection critic and the prompted critic's llama.cpp backend) run
blocking native decodes from async code. They do it the same way: one
:class:`~llama_index.packs.self_rag_rse.common.bridge.SerialWorker` thread per decoder, so
decodes reach llama.cpp in order and never compete for the cores, and every call holds the
decoder, so the model cannot be closed half-way through it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.packs.self_rag_rse.common.bridge import SerialWorker
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder
from llama_index.packs.self_rag_rse.self_rag.steps import unsent_rest

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
        throughout and ``Llama.close()`` waits for it)."""
        return await self._worker.run(self._held, func, *args)

    async def stream(self, func: Callable[..., str], /, *args: Any) -> AsyncIterator[str]:
        """Run ``func(*args, on_text)`` on the worker thread; yield its text as it grows.

        ``func`` decodes, calls ``on_text(text so far)`` after each token (on the worker thread,
        holding the decoder) and returns the final text; the pieces yielded join to it. A
        consumer that stops early does not stop the decode (llama.cpp cannot be interrupted
        mid-step): it finishes in the background.
        """
        loop = asyncio.get_running_loop()
        texts: asyncio.Queue[str | None] = asyncio.Queue()

        def on_text(text: str) -> None:
            loop.call_soon_threadsafe(texts.put_nowait, text)

        task = asyncio.ensure_future(self.run(func, *args, on_text))
        task.add_done_callback(lambda _: texts.put_nowait(None))
        emitted = ""
        try:
            while (text := await texts.get()) is not None:
                if len(text) > len(emitted) and text.startswith(emitted):
                    yield text[len(emitted) :]
                    emitted = text
            final = await task
        finally:
            if not task.done():
                task.add_done_callback(_retrieve_exception)
        if rest := unsent_rest(emitted, final):
            yield rest

    def _held(self, func: Callable[..., T], *args: Any) -> T:
        with self.decoder.hold():
            return func(*args)

    def close(self) -> None:
        """Wait for running work, then free the decoder's context (the model stays open)."""
        self._worker.close()
        self.decoder.close()


def _retrieve_exception(task: asyncio.Future[Any]) -> None:
    """Mark an abandoned decode's failure as seen (nobody is left to raise it to)."""
    if not task.cancelled() and task.exception() is not None:
        logger.debug("abandoned streamed decode failed: %s", task.exception())
