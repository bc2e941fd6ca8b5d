"""Where each chunk of a document lies: its offsets found again in the document's own text.

LlamaIndex splitters find a chunk's offsets by searching its text from the previous chunk's
start, so in text that repeats (a phrase repeated in Japanese, identical log lines, a line of
"~~~~") a chunk can be placed at an earlier copy of its text, while the copy it really holds lies
in no chunk's range. Where the document's text is at hand (:class:`~.sectioner.DocumentSectioner`
has it; ``ChunkIndexer(documents=...)`` is given it), :func:`place_chunks` puts every chunk back
at its own copy and marks it ``chunk_offsets_checked`` (:data:`~.keys.OFFSETS_CHECKED_KEY`): RSE
then trusts those offsets where repeated text would otherwise make it doubt them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from llama_index.core.schema import BaseNode, TextNode

from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY

_NON_SPACE = re.compile(r"\S")


def place_chunks(text: str, chunks: Sequence[BaseNode]) -> None:
    """Give ``chunks`` (a splitter's cut of ``text``, in order) their true offsets in ``text``
    and mark them checked, when all of them can be placed; else leave them as they are.

    A splitter covers every character that is not whitespace, in order: each chunk holds the
    first character the chunks before it left out. So each chunk goes to the copy of its text
    that holds that character and reaches furthest; with no repeated text that is where the
    splitter's own search put it. The placement holds when every chunk has such a copy and
    together they hold all of ``text`` but whitespace; a chunk without one (empty, a token
    splitter's chunk repeating the previous one's tail, a text that is not this document's)
    leaves every chunk's offsets as the splitter gave them.
    """
    placed: list[tuple[TextNode, int]] = []
    covered = 0  # the chunks placed so far hold all text before this position
    for chunk in chunks:
        content = chunk.get_content()
        left_out = _NON_SPACE.search(text, covered)  # the first character left out
        if left_out is None or not content or not isinstance(chunk, TextNode):
            return
        first = left_out.start()
        found = text.rfind(content, max(0, first - len(content) + 1), first + len(content))
        if found < 0:
            return
        placed.append((chunk, found))
        covered = found + len(content)
    if _NON_SPACE.search(text, covered) is not None:
        return
    for chunk, start in placed:
        chunk.start_char_idx = start
        chunk.end_char_idx = start + len(chunk.get_content())
        chunk.metadata[OFFSETS_CHECKED_KEY] = True
