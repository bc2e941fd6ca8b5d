"""Stream helpers both transports and the Self-RAG engine read: what a stream still owes of
its final text, and a stream held to its stripped answer.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterable, Callable, Generator, Iterable

logger = logging.getLogger(__name__)


def unsent_rest(emitted: str, final: str) -> str:
    """What of the ``final`` answer a stream that already sent ``emitted`` still owes; when
    later tokens rewrote text already sent (detokenizing more bytes can), nothing more is sent
    and a warning shows both, so the difference is never silent.
    """
    if final.startswith(emitted):
        return final[len(emitted) :]
    logger.warning("streamed text %r is not a prefix of the final answer %r", emitted, final)
    return ""


def stripped(pieces: Iterable[str], final: Callable[[str], str]) -> Generator[str, None, None]:
    """``pieces`` with the answer's outer whitespace held back, so that they join to the
    stripped answer (what a non-streamed response holds); an all-whitespace answer becomes
    ``final("")`` (the engine's no-answer text).
    """
    holder = Stripper()
    for piece in pieces:
        if text := holder.feed(piece):
            yield text
    if holder.empty:
        yield final("")


async def astripped(
    pieces: AsyncIterable[str], final: Callable[[str], str]
) -> AsyncGenerator[str, None]:
    """Async :func:`stripped`."""
    holder = Stripper()
    async for piece in pieces:
        if text := holder.feed(piece):
            yield text
    if holder.empty:
        yield final("")


class Stripper:
    """Text fed in pieces, given back so that it joins to the stripped whole: leading
    whitespace dropped, trailing whitespace held until more text follows.
    """

    def __init__(self) -> None:
        self.empty = True
        self._pending = ""

    def feed(self, piece: str) -> str:
        """The text of ``piece`` that can be given now ("" while only whitespace came)."""
        if self.empty:
            piece = piece.lstrip()
            if not piece:
                return ""
            self.empty = False
        text = self._pending + piece
        body = text.rstrip()
        self._pending = text[len(body) :]
        return body
