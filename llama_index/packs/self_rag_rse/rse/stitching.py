"""Rebuild a document span from consecutive chunks without duplicating overlap or inventing text.

Splitters with ``chunk_overlap`` repeat text at every boundary; splitters without it strip the
whitespace between chunks. Given each chunk's character span (``start_char_idx`` / ``end_char_idx``,
which LlamaIndex's splitters record), the overlap is cut exactly and a stripped gap is refilled with
whitespace of the same length. Offsets are evidence, not truth: the text an overlap cut drops must
be the text already stitched, and a gap can only be as wide as a splitter strips. Where the offsets
fail either check, or a chunk carries none, the overlap is found by matching the end of the text so
far against the start of the next chunk; where that fails too, the boundary is a *hole*, and the
chunks come back as separate pieces rather than joined over text nobody has. No LlamaIndex import.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

#: Shortest suffix/prefix match accepted as overlap when offsets cannot place a boundary;
#: shorter matches ("the ", ". ") are more likely coincidence than overlap.
MIN_TEXT_OVERLAP = 16

#: Widest gap between one chunk's end offset and the next chunk's start offset taken as stripped
#: whitespace on the offsets' word alone (a space, a line break, a paragraph break and a stray
#: space). Wider is text that no chunk holds (a deleted chunk) or offsets that are wrong, unless
#: the chunks link to each other (see :data:`MAX_LINKED_GAP`).
MAX_STRIPPED_GAP = 4

#: Widest gap taken as stripped whitespace between two chunks the splitter linked as neighbours
#: (NEXT/PREVIOUS), which proves no chunk was deleted between them. Splitters strip the
#: whitespace at a cut: blank lines plus the next line's indentation, up to 32 characters on the
#: shipped Python reference. Beyond 64, a wrong offset is the likelier story (LlamaIndex finds a
#: chunk's offset with ``str.find``, which can land on a later copy of repeated text).
MAX_LINKED_GAP = 64

Span = tuple[int | None, int | None]


@dataclass(frozen=True)
class StitchedText:
    """A stitched run of chunks ``[first, stop)`` (indices into the chunks given).

    ``start_char`` / ``end_char`` are its character range in the source, or ``None`` when the
    offsets are missing or some chunk's offsets were contradicted by the texts. ``gaps`` counts
    the boundaries whose characters no chunk held and that were refilled as whitespace: with the
    stripped width when offsets give it, else one newline.
    """

    text: str
    start_char: int | None
    end_char: int | None
    gaps: int
    first: int = 0
    stop: int = 1


@dataclass(frozen=True)
class Break:
    """Why chunks ``index - 1`` and ``index`` of a stitch could not be joined."""

    index: int
    reason: str


def stitch_chunks(
    texts: Sequence[str],
    spans: Sequence[Span] | None = None,
    linked: Sequence[bool] | None = None,
    distrust: Sequence[bool] | None = None,
) -> list[StitchedText]:
    """Join consecutive chunk texts of one document into the text of the span(s) they cover.

    - ``spans``: each chunk's ``(start_char_idx, end_char_idx)``. A missing span, or one whose
      length differs from its text's, is ignored: that chunk is joined by text matching.
    - ``linked``: ``linked[i]`` says chunks ``i - 1`` and ``i`` link to each other by
      NEXT/PREVIOUS (``linked[0]`` is ignored); it admits stripped gaps up to
      :data:`MAX_LINKED_GAP` and, without offsets, a join with no text overlap.
    - ``distrust``: chunks whose offsets to ignore, e.g. found suspect (:func:`suspect_offsets`)
      next to neighbours that are not passed here.

    Offsets are checked against the texts first: a chunk whose claimed overlap with a neighbour
    is not the neighbour's text, or which starts before its predecessor, has its offsets ignored,
    and no range is reported for the piece holding it. Chunks must be given in document order.
    Returns one :class:`StitchedText` per run of chunks with no hole between them (a single
    element when every boundary joined); :func:`find_breaks` says why a boundary did not.
    """
    return stitch_with_breaks(texts, spans, linked, distrust)[0]


def find_breaks(
    texts: Sequence[str],
    spans: Sequence[Span] | None = None,
    linked: Sequence[bool] | None = None,
    distrust: Sequence[bool] | None = None,
) -> list[Break]:
    """The boundaries :func:`stitch_chunks` would not join, with the reason for each.

    A boundary breaks when the texts do not overlap by :data:`MIN_TEXT_OVERLAP` characters and
    the offsets leave a gap wider than a splitter strips, or the offsets cannot be trusted and
    the chunks are not linked as neighbours.
    """
    return stitch_with_breaks(texts, spans, linked, distrust)[1]


def suspect_offsets(texts: Sequence[str], spans: Sequence[Span]) -> list[bool]:
    """Which chunks' offsets the texts contradict, judged from each pair of neighbours.

    Where two neighbours' offsets claim an overlap, the next chunk must start with the end of
    the previous one; where it does not, or the next chunk starts before the previous one or
    ends inside it, both are suspect (which one is wrong cannot be told). A gap is no evidence
    here: text repeated across a cut is legitimate; only the gap's width can be judged, which
    :func:`stitch_chunks` does.
    """
    suspect = [False] * len(texts)
    shown = [i for i, text in enumerate(texts) if text]  # an empty chunk shows no boundary
    for h, i in itertools.pairwise(shown):
        (start_a, end_a), (start_b, end_b) = spans[h], spans[i]
        if not (_usable(texts[h], spans[h]) and _usable(texts[i], spans[i])):
            continue
        assert start_a is not None and end_a is not None and start_b is not None
        assert end_b is not None
        left, right = texts[h], texts[i]
        shift = end_a - start_b
        if start_b < start_a or end_b <= end_a:
            # Splitters place a chunk by searching its text, so one that ends inside the previous
            # one may sit at an earlier copy of repeated text while its real copy is in no range.
            # Distrusted, it stands apart: a chunk that truly repeats the previous one's tail (a
            # token splitter's overlap) is then shown twice, and no real copy is ever dropped.
            agrees = False
        elif shift > 0:
            covered = min(shift, len(right))
            agrees = right[:covered] == left[len(left) - shift : len(left) - shift + covered]
            # Repeated text: a shorter overlap fits too (the splitter may have found a copy).
            agrees = agrees and not _overlaps(right[1:covered], right[:covered])
        else:
            # A gap cannot be checked against the texts: the end of one chunk may well be
            # repeated at the start of the next ("... | name" then "name ::= ...").
            agrees = True
        if not agrees:
            suspect[h] = suspect[i] = True
    return suspect


def _usable(text: str, span: Span) -> bool:
    start, end = span
    return start is not None and end is not None and end - start == len(text)


def stitch_with_breaks(
    texts: Sequence[str],
    spans: Sequence[Span] | None,
    linked: Sequence[bool] | None,
    distrust: Sequence[bool] | None,
) -> tuple[list[StitchedText], list[Break]]:
    """:func:`stitch_chunks` and :func:`find_breaks` in one pass: the pieces, and a break
    between every two of them.
    """
    if not texts:
        return [StitchedText("", None, None, 0, 0, 0)], []
    spans = [(None, None)] * len(texts) if spans is None else list(spans)
    links = [False] * len(texts) if linked is None else list(linked)
    doubts = [False] * len(texts) if distrust is None else list(distrust)
    if not len(spans) == len(links) == len(doubts) == len(texts):
        raise ValueError(
            f"got {len(texts)} chunk texts, {len(spans)} spans, {len(links)} link flags and "
            f"{len(doubts)} distrust flags; pass one of each per chunk"
        )
    suspect = [a or b for a, b in zip(suspect_offsets(texts, spans), doubts, strict=True)]
    trusted = [
        span if _usable(text, span) and not doubt else (None, None)
        for text, span, doubt in zip(texts, spans, suspect, strict=True)
    ]
    pieces: list[StitchedText] = []
    breaks: list[Break] = []
    run = _Run(texts[0], trusted[0], 0, suspect[0])
    for i in range(1, len(texts)):
        if not texts[i]:  # an empty chunk neither joins nor breaks; it keeps the last one's doubt
            suspect[i] = suspect[i - 1]
            continue
        if not run.length:  # only empty chunks so far: the text starts here
            run = _Run(texts[i], trusted[i], run.first, suspect[i])
            continue
        reason = run.add(texts[i], trusted[i], links[i], suspect[i - 1] or suspect[i])
        if reason is not None:
            breaks.append(Break(i, reason))
            pieces.append(run.finish(i))
            run = _Run(texts[i], trusted[i], i, suspect[i])
        elif suspect[i]:
            run.contradicted = True
    pieces.append(run.finish(len(texts)))
    return pieces, breaks


class _Run:
    """A run of chunks being stitched: its parts, its end in source coordinates, its doubts."""

    def __init__(self, text: str, span: Span, first: int, suspect: bool) -> None:
        self.parts, self.length, self.first = [text], len(text), first
        self.start_char, self.end_char = span  # end: None once offsets could not place a boundary
        self.gaps, self.contradicted = 0, suspect  # contradicted offsets: no range to report

    def tail(self, size: int) -> str:
        """The last ``size`` characters stitched so far (``size <= self.length``)."""
        out: list[str] = []
        needed = size
        for part in reversed(self.parts):
            if needed <= 0:
                break
            out.append(part[-needed:] if needed < len(part) else part)
            needed -= len(part)
        return "".join(reversed(out))[-size:] if size else ""

    def add(self, text: str, span: Span, linked: bool, suspect: bool) -> str | None:
        """Append the next chunk; return why it cannot be joined (a hole), or ``None``."""
        start, end = span
        if self.end_char is not None and start is not None and end is not None:
            shift = self.end_char - start  # > 0: overlap the offsets claim; < 0: a gap
            widest = MAX_LINKED_GAP if linked else MAX_STRIPPED_GAP
            if 0 <= shift <= self.length:
                covered = min(shift, len(text))
                # The cut-off prefix must be the text we already have, where the offsets say.
                if text[:covered] == self.tail(shift)[:covered]:
                    if shift < len(text):
                        self._append(text[shift:])
                        self.end_char = end
                    return None  # a chunk inside what we already have adds nothing
                why = f"offsets claim a {shift}-character overlap the texts do not share"
            elif shift < 0 and -shift <= widest:
                # The splitter stripped -shift characters here (only whitespace: LlamaIndex's
                # splitters strip nothing else); keep the width so offsets stay true.
                self.gaps += 1
                self._append(_filler(-shift) + text)
                self.end_char = end
                return None
            elif shift < 0:
                why = (
                    f"offsets leave a {-shift}-character gap, wider than the {widest} a splitter "
                    f"strips between {'linked' if linked else 'unlinked'} chunks"
                )
            else:
                why = f"offsets claim a {shift}-character overlap, longer than the text so far"
            # Offsets are wrong somewhere, or a chunk is missing: only the texts can join now.
            overlap = _text_overlap(self.tail(min(self.length, len(text))), text)
            if not overlap:
                return why
            self.contradicted = True
            self._append(text[overlap:])
            self.end_char = None
            return None
        overlap = _text_overlap(self.tail(min(self.length, len(text))), text)
        if overlap:
            self._append(text[overlap:])
        elif linked or not suspect:
            # No offsets say how wide the stripped gap was, but the links (or, for chunks that
            # never had offsets, the store's order) say the chunks are neighbours: mark the
            # boundary with one newline and report no range.
            self.gaps += 1
            self._append("\n" + text)
        else:
            return "the texts contradict the offsets and do not overlap, and no link joins them"
        self.end_char = None
        return None

    def _append(self, part: str) -> None:
        self.parts.append(part)
        self.length += len(part)

    def finish(self, stop: int) -> StitchedText:
        text = "".join(self.parts)
        if self.contradicted:
            return StitchedText(text, None, None, self.gaps, self.first, stop)
        start, end = self.start_char, self.end_char
        if end is None and start is not None and self.gaps == 0:
            end = start + len(text)
        if start is None or end is None or end - start != len(text):
            start = end = None  # a newline standing for a gap of unknown width: no true range
        return StitchedText(text, start, end, self.gaps, self.first, stop)


def _filler(width: int) -> str:
    # One stripped character is almost always a space; more is a line or paragraph break.
    return " " if width == 1 else "\n" * width


def _text_overlap(left: str, right: str) -> int:
    """The one overlap :func:`_overlaps` finds; 0 for none or several (repeated text)."""
    found = _overlaps(left, right)
    return found[0] if len(found) == 1 else 0


def _overlaps(left: str, right: str) -> list[int]:
    """Lengths of ``left``'s suffixes (MIN_TEXT_OVERLAP at least) that begin ``right``."""
    probe, found, at = right[:MIN_TEXT_OVERLAP], [], max(0, len(left) - len(right)) - 1
    while len(probe) == MIN_TEXT_OVERLAP and (at := left.find(probe, at + 1)) != -1:
        if right.startswith(left[at:]):
            found.append(len(left) - at)
    return found
