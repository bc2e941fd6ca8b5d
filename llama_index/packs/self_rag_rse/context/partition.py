"""Check and repair an LLM's partition of numbered lines into sections (pure Python).

The LLM strategy shows the model one window of a document's lines, numbered, and asks for
sections as (title, first line, last line). What comes back is a claim, not a partition: it may be
out of order, overlap, leave gaps, start outside the window, or cut the text into one-line
pieces. :func:`repair_partition` keeps what can be trusted and makes the rest exact:

- sections whose first line lies outside the window are dropped, duplicates of a first line too;
- sections are sorted by first line, and the first one is moved to the window's first line;
- every section then ends where the next begins (the last at the window's end), which removes
  overlaps and gaps: only the first lines and titles of the answer are used;
- sections with fewer than ``min_lines`` non-blank lines are merged into the next one.

It raises :class:`PartitionError`, naming the window, when nothing usable is left: no section
starting inside the window, or an answer that is mostly one-line pieces (a model listing lines,
not sections). :func:`plan_next_window` stitches windows: the last section of a window that does
not reach the document's end may be cut, so the next window starts again at its first line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llama_index.packs.self_rag_rse.context.sections import LineIndex, SectionStart

#: Longest title kept from a model; longer ones are cut at a word boundary.
MAX_TITLE_CHARS = 120


class PartitionError(ValueError):
    """The model's sections for a window could not be repaired into a partition."""


@dataclass
class RepairedPartition:
    """Section starts for one window, in order, the first at the window's first line, and the
    repairs that were needed (empty when the model's answer was already a partition).
    """

    starts: list[SectionStart]
    repairs: list[str] = field(default_factory=list)


def window_end(index: LineIndex, first: int, window_chars: int, max_line_chars: int) -> int:
    """Last line (inclusive) of the window starting at ``first``: as many lines as fit in
    ``window_chars`` characters when rendered, at least one.
    """
    used = 0
    last = first
    for i in range(first, len(index)):
        cost = _rendered_len(index, i, max_line_chars)
        if i > first and used + cost > window_chars:
            break
        used += cost
        last = i
    return last


def render_window(index: LineIndex, first: int, last: int, max_line_chars: int) -> str:
    """Lines ``first..last`` as ``[n] text``, blank lines left out (they cost tokens and carry
    no structure), each line cut to ``max_line_chars`` characters.
    """
    return "\n".join(
        _render(index, i, max_line_chars) for i in range(first, last + 1) if not index.is_blank(i)
    )


def repair_partition(
    proposed: Sequence[tuple[str, int, int | None]],
    index: LineIndex,
    first: int,
    last: int,
    *,
    min_lines: int = 2,
    window_name: str = "",
) -> RepairedPartition:
    """Turn the model's ``(title, first_line, last_line)`` sections for window ``first..last``
    into section starts that partition the window (see the module docstring).
    """
    where = window_name or f"lines {first}-{last}"
    repairs: list[str] = []
    inside = [(t, s, e) for t, s, e in proposed if isinstance(s, int) and first <= s <= last]
    if len(inside) < len(proposed):
        repairs.append(f"dropped {len(proposed) - len(inside)} section(s) starting outside")
    if not inside:
        raise PartitionError(
            f"{where}: the model returned no section starting inside the window "
            f"({len(proposed)} section(s) in all); nothing to repair"
        )
    ordered = sorted(inside, key=lambda span: span[1])
    if [s for _, s, _ in ordered] != [s for _, s, _ in inside]:
        repairs.append("sorted sections by first line")
    # Of several sections starting on one line, the first wins.
    unique = [span for k, span in enumerate(ordered) if k == 0 or ordered[k - 1][1] != span[1]]
    if len(unique) < len(ordered):
        repairs.append(f"dropped {len(ordered) - len(unique)} duplicate first line(s)")
    if unique[0][1] != first:
        repairs.append(f"moved the first section's start from line {unique[0][1]} to {first}")
        unique[0] = (unique[0][0], first, unique[0][2])
    claimed_ends = [e for _, _, e in unique]
    exact_ends = [s - 1 for _, s, _ in unique[1:]] + [last]  # each ends where the next begins
    if claimed_ends != exact_ends:
        repairs.append("made each section end where the next begins (overlaps or gaps)")
    starts = [SectionStart(s, _clean_title(t, index, s), ()) for t, s, _ in unique]
    return RepairedPartition(_merge_short(starts, index, last, min_lines, where, repairs), repairs)


def plan_next_window(
    starts: list[SectionStart], first: int, last: int, n_lines: int
) -> tuple[list[SectionStart], int | None]:
    """Which starts of window ``first..last`` to keep, and where the next window begins
    (``None`` after the document's last line).

    The window's last section may continue past ``last``, so unless the window reaches the end
    of the document it is handed to the next window, which starts at its first line. A window
    with a single section keeps it and the next window starts after ``last``.
    """
    if last >= n_lines - 1:
        return starts, None
    if len(starts) == 1:
        return starts, last + 1
    return starts[:-1], starts[-1].line


def _merge_short(
    starts: list[SectionStart],
    index: LineIndex,
    last: int,
    min_lines: int,
    where: str,
    repairs: list[str],
) -> list[SectionStart]:
    """Merge sections shorter than ``min_lines`` non-blank lines into the next one (a heading
    directly followed by a subheading reads best under the subheading). The last section is
    left alone: the window's end may have cut it, and the next window reads it again. Reject an
    answer made mostly of short pieces.
    """
    if min_lines <= 1 or len(starts) == 1:
        return starts
    bounds = [s.line for s in starts[1:]] + [last + 1]
    sizes = [
        sum(1 for i in range(start.line, stop) if not index.is_blank(i))
        for start, stop in zip(starts, bounds, strict=True)
    ]
    short = sum(1 for size in sizes[:-1] if size < min_lines)
    if not short:
        return starts
    if len(starts) >= 4 and short * 2 > len(starts):
        raise PartitionError(
            f"{where}: {short} of {len(starts)} sections have fewer than {min_lines} "
            "non-blank lines: the model listed lines, not sections"
        )
    kept: list[SectionStart] = []
    carry: int | None = None  # first line of short sections waiting for the next one
    for start, size in zip(starts[:-1], sizes[:-1], strict=True):
        if size < min_lines:
            carry = start.line if carry is None else carry
            continue
        kept.append(SectionStart(start.line if carry is None else carry, start.title, start.path))
        carry = None
    final = starts[-1]
    kept.append(SectionStart(final.line if carry is None else carry, final.title, final.path))
    repairs.append(f"merged {short} section(s) shorter than {min_lines} lines into the next")
    return kept


def _clean_title(title: object, index: LineIndex, line: int) -> str:
    text = " ".join(str(title or "").split()).strip(" \"'`*#")
    if not text:
        # An untitled section is named by its first words rather than left blank.
        text = next((" ".join(s.split()) for s in index.lines[line:] if s.strip()), "")
    if len(text) > MAX_TITLE_CHARS:
        text = text[:MAX_TITLE_CHARS].rsplit(" ", 1)[0] + "…"
    return text


def _render(index: LineIndex, i: int, max_line_chars: int) -> str:
    line = index.lines[i].rstrip()
    if len(line) > max_line_chars:
        line = line[:max_line_chars] + "…"
    return f"[{i}] {line}"


def _rendered_len(index: LineIndex, i: int, max_line_chars: int) -> int:
    return 0 if index.is_blank(i) else len(_render(index, i, max_line_chars)) + 1
