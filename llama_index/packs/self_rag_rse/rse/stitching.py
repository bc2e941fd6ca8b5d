"""Rebuild a document span from consecutive chunks without duplicating overlap or inventing text.

Splitters with ``chunk_overlap`` repeat text at every boundary; splitters without it strip the
whitespace between chunks. Given each chunk's character span (``start_char_idx`` / ``end_char_idx``,
which LlamaIndex's splitters record), the overlap is cut exactly and a stripped gap is refilled with
whitespace of the same length. Offsets are evidence, not truth: the text an overlap cut drops must
be the text already stitched, a gap can only be as wide as a splitter strips, and where the text
repeats, splitters (which place a chunk by searching its text) may have put a chunk at an earlier
copy, so a boundary that repeated text could explain another way is not trusted unless the
offsets were checked against the document at ingestion. Where the offsets fail, or a chunk carries
none, the overlap is found by matching the end of the text so far against the start of the next
chunk, when only one overlap fits; else linked neighbours are joined whole by a line break
(counted in ``gaps``), and any other boundary is a *hole*: the chunks come back as separate pieces
rather than joined over text nobody has, and no copy of repeated text is lost. No LlamaIndex
import.
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
    checked: Sequence[bool] | None = None,
) -> list[StitchedText]:
    """Join consecutive chunk texts of one document into the text of the span(s) they cover.

    - ``spans``: each chunk's ``(start_char_idx, end_char_idx)``. A missing span, or one whose
      length differs from its text's, is ignored: that chunk is joined by text matching.
    - ``linked``: ``linked[i]`` says chunks ``i - 1`` and ``i`` link to each other by
      NEXT/PREVIOUS (``linked[0]`` is ignored); it admits stripped gaps up to
      :data:`MAX_LINKED_GAP` and, without offsets, a join with no text overlap.
    - ``distrust``: chunks whose offsets to ignore, e.g. found suspect (:func:`suspect_offsets`)
      next to neighbours that are not passed here.
    - ``checked``: chunks whose offsets were checked against the document at ingestion (see
      :func:`suspect_offsets`).

    Offsets are checked against the texts first: a chunk whose claimed overlap with a neighbour
    is not the neighbour's text, or which starts before its predecessor, has its offsets ignored,
    and no range is reported for the piece holding it. Chunks must be given in document order.
    Returns one :class:`StitchedText` per run of chunks with no hole between them (a single
    element when every boundary joined); :func:`find_breaks` says why a boundary did not.
    """
    return stitch_with_breaks(texts, spans, linked, distrust, checked)[0]


def find_breaks(
    texts: Sequence[str],
    spans: Sequence[Span] | None = None,
    linked: Sequence[bool] | None = None,
    distrust: Sequence[bool] | None = None,
    checked: Sequence[bool] | None = None,
) -> list[Break]:
    """The boundaries :func:`stitch_chunks` would not join, with the reason for each.

    A boundary breaks when the texts do not overlap by :data:`MIN_TEXT_OVERLAP` characters and
    the offsets leave a gap wider than a splitter strips, or the offsets cannot be trusted and
    the chunks are not linked as neighbours.
    """
    return stitch_with_breaks(texts, spans, linked, distrust, checked)[1]


def suspect_offsets(
    texts: Sequence[str], spans: Sequence[Span], checked: Sequence[bool] | None = None
) -> list[bool]:
    """Which chunks' offsets the texts contradict or cannot vouch for, judged from each pair of
    neighbours (which of the two is wrong cannot be told, so both are suspect).

    Where two neighbours' offsets claim an overlap, the next chunk must start with the end of
    the previous one, and must not start before the previous one or end inside it. And where the
    text repeats, the claim (an overlap or a gap) must be the only one the texts allow: a
    splitter that placed one of the two at an earlier copy of its text (:func:`_ambiguous`)
    would have claimed just this while the document holds another overlap, and cutting or
    refilling by it would drop a copy or put whitespace where the document has text. Pairs
    whose ``checked`` offsets were both found again in the document at ingestion are exempt
    from that doubt. A gap's width is judged by :func:`stitch_chunks`.
    """
    suspect = [False] * len(texts)
    verified = [False] * len(texts) if checked is None else list(checked)
    shown = [i for i, text in enumerate(texts) if text]  # an empty chunk shows no boundary
    for h, i in itertools.pairwise(shown):
        start_a, end_a = spans[h]
        start_b, end_b = spans[i]
        if not (_usable(texts[h], spans[h]) and _usable(texts[i], spans[i])):
            continue
        assert (
            start_a is not None and end_a is not None and start_b is not None and end_b is not None
        )
        left = texts[h]
        right = texts[i]
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
        else:
            # A gap's characters are in neither text: the end of one chunk may well be repeated
            # at the start of the next ("... | name" then "name ::= ...").
            agrees = True
        if agrees and not (verified[h] and verified[i]):
            agrees = not _ambiguous(left, right, shift)
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
    checked: Sequence[bool] | None = None,
) -> tuple[list[StitchedText], list[Break]]:
    """:func:`stitch_chunks` and :func:`find_breaks` in one pass: the pieces, and a break
    between every two of them.
    """
    if not texts:
        empty = StitchedText(text="", start_char=None, end_char=None, gaps=0, first=0, stop=0)
        return [empty], []
    spans = [(None, None)] * len(texts) if spans is None else list(spans)
    links = [False] * len(texts) if linked is None else list(linked)
    doubts = [False] * len(texts) if distrust is None else list(distrust)
    if not len(spans) == len(links) == len(doubts) == len(texts):
        raise ValueError(
            f"got {len(texts)} chunk texts, {len(spans)} spans, {len(links)} link flags and "
            f"{len(doubts)} distrust flags; pass one of each per chunk"
        )
    found = suspect_offsets(texts, spans, checked)
    suspect = [a or b for a, b in zip(found, doubts, strict=True)]
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
        self.parts = [text]
        self.length = len(text)
        self.first = first
        self.start_char, self.end_char = span  # end: None once offsets could not place a boundary
        self.gaps = 0
        self.contradicted = suspect  # contradicted offsets: no range to report

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
        start = self.start_char
        end = self.end_char
        if end is None and start is not None and self.gaps == 0:
            end = start + len(text)
        # Contradicted offsets, or a newline standing for a gap of unknown width: no true range.
        if self.contradicted or start is None or end is None or end - start != len(text):
            start = end = None
        return StitchedText(
            text=text,
            start_char=start,
            end_char=end,
            gaps=self.gaps,
            first=self.first,
            stop=stop,
        )


def _filler(width: int) -> str:
    # One stripped character is almost always a space; more is a line or paragraph break.
    return " " if width == 1 else "\n" * width


def _text_overlap(left: str, right: str) -> int:
    """The one overlap :func:`_overlaps` finds; 0 for none, or one repeated text could explain
    another way (:func:`_ambiguous`: several fit, or a chunk repeats itself).
    """
    found = _overlaps(left, right)
    if len(found) != 1 or _ambiguous(left, right, found[0]):
        return 0
    return found[0]


def _ambiguous(left: str, right: str, shift: int) -> bool:
    """Whether repeated text could put ``right`` after ``left`` otherwise than overlapping by
    ``shift`` characters (a gap when below 0), as a splitter's offsets or a text match claim.

    Splitters place a chunk by searching its text forward, so one can sit at an earlier copy of
    itself, and a text match can take one copy for another. Another overlap (none, or one the
    texts allow: ``left`` ends with what ``right`` begins with) is as likely as the one claimed
    when a chunk reads the same moved by the difference (:func:`_repeats`). Prose never does; a
    phrase, a log line or a table row repeated does.
    """
    for other in [0, *_overlaps(left, right, shortest=1)]:
        distance = abs(shift - other)
        if other != shift and (_repeats(left, distance) or _repeats(right, distance)):
            return True
    return False


def _repeats(text: str, distance: int) -> bool:
    """Whether ``text`` reads the same moved ``distance`` characters on: it repeats every
    ``distance`` characters, or (moved past its end) every ``period`` characters, ``period`` a
    divisor of ``distance`` that fits in ``text`` twice.
    """
    periods = [distance] if distance < len(text) else range(1, len(text) // 2 + 1)
    return any(
        distance % period == 0 and text[period:] == text[: len(text) - period] for period in periods
    )


def _overlaps(left: str, right: str, shortest: int = MIN_TEXT_OVERLAP) -> list[int]:
    """Lengths (``shortest`` at least) of ``left``'s suffixes that begin ``right``."""
    probe = right[:shortest]
    found: list[int] = []
    at = max(0, len(left) - len(right)) - 1  # where the search for the probe resumes, less one
    while len(probe) == shortest and (at := left.find(probe, at + 1)) != -1:
        if right.startswith(left[at:]):
            found.append(len(left) - at)
    return found
