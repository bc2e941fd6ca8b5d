"""Rebuild a document span from consecutive chunks without duplicating overlap.

Splitters with ``chunk_overlap`` repeat text at every boundary; splitters without it strip the
whitespace between chunks. Given each chunk's character span (``start_char_idx`` /
``end_char_idx``, which LlamaIndex's splitters record), the overlap is cut exactly and a stripped
gap is refilled with whitespace of the same length. Without spans, the overlap is found by
matching the end of the text so far against the start of the next chunk. No LlamaIndex import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Shortest suffix/prefix match accepted as overlap when chunks carry no character spans;
#: shorter matches ("the ", ". ") are more likely coincidence than overlap.
MIN_TEXT_OVERLAP = 16


@dataclass(frozen=True)
class StitchedText:
    """A stitched span: its text, its character range in the source (when known) and how many
    chunk boundaries had a gap whose original characters were not available (refilled with
    whitespace of the same length, or a newline when the length is unknown)."""

    text: str
    start_char: int | None
    end_char: int | None
    gaps: int


def stitch_chunks(
    texts: Sequence[str],
    spans: Sequence[tuple[int | None, int | None]] | None = None,
) -> StitchedText:
    """Join consecutive chunk texts of one document into the text of the span they cover.

    ``spans`` holds each chunk's ``(start_char_idx, end_char_idx)``; a chunk with a missing or
    inconsistent span (its length differs from its text's) falls back to text matching for its
    boundary. Chunks must be given in document order.
    """
    if not texts:
        return StitchedText("", None, None, 0)
    if spans is None:
        spans = [(None, None)] * len(texts)
    if len(spans) != len(texts):
        raise ValueError(f"got {len(texts)} chunk texts but {len(spans)} spans; pass one per chunk")

    def usable(i: int) -> bool:
        start, end = spans[i]
        return start is not None and end is not None and end - start == len(texts[i])

    parts = [texts[0]]
    gaps = 0
    # End of the text so far in source coordinates; None once a boundary could not be placed.
    end_char = spans[0][1] if usable(0) else None
    for i in range(1, len(texts)):
        text = texts[i]
        start = spans[i][0]
        if end_char is not None and usable(i) and start is not None:
            shift = end_char - start
            if shift >= len(text):
                continue  # entirely inside what we already have
            if shift >= 0:
                parts.append(text[shift:])
            else:
                # The splitter dropped -shift characters here (whitespace for LlamaIndex's
                # splitters); keep the length so character offsets stay true.
                gaps += 1
                parts.append(_filler(-shift) + text)
            end_char = spans[i][1]
        else:
            so_far = "".join(parts)
            overlap = _text_overlap(so_far, text)
            if overlap:
                parts.append(text[overlap:])
            else:
                gaps += 1
                parts.append("\n" + text)
            end_char = spans[i][1] if usable(i) and end_char is not None and overlap else None
    start_char = spans[0][0] if usable(0) else None
    stitched = "".join(parts)
    if end_char is None and start_char is not None and gaps == 0:
        end_char = start_char + len(stitched)
    return StitchedText(stitched, start_char, end_char, gaps)


def _filler(width: int) -> str:
    # One stripped character is almost always a space; more is a line or paragraph break.
    return " " if width == 1 else "\n" * width


def _text_overlap(left: str, right: str) -> int:
    """Length of the longest suffix of ``left`` that is a prefix of ``right`` (0 if too short)."""
    longest = min(len(left), len(right))
    for size in range(longest, MIN_TEXT_OVERLAP - 1, -1):
        if left.endswith(right[:size]):
            return size
    return 0
