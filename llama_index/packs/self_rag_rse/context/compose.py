"""The words of a contextual header (pure Python).

A header says where a chunk comes from, in a line or two, so that a chunk reading "the treatment
is X" is found by a question naming the disease the document is about::

    Document: Compound statements
    Section: The "try" statement > "except" clause

Summaries, when asked for, follow their title on the same line. RSE segments get the same shape
once per segment; a segment spanning several sections names them all.
"""

from __future__ import annotations

from collections.abc import Sequence

#: Joins the titles of a section path.
PATH_SEPARATOR = " > "
#: Most section paths named in a segment header before the rest are elided.
MAX_SEGMENT_SECTIONS = 4


def section_label(path: Sequence[str]) -> str:
    """A section path as one label: ``"The match statement > OR Patterns"``."""
    return PATH_SEPARATOR.join(p for p in path if p)


def compose_header(
    title: str | None,
    summary: str | None = None,
    section: Sequence[str] = (),
    section_summary: str | None = None,
) -> str:
    """The header of one chunk: a document line and, when the chunk has a section, a section
    line. Empty parts are left out; a section that merely repeats the document title too.
    """
    lines = []
    if title or summary:
        lines.append(_line("Document", title, summary))
    label = section_label(section)
    if (label and label != (title or "")) or section_summary:
        lines.append(_line("Section", label, section_summary))
    return "\n".join(lines)


def compose_segment_header(
    title: str | None, summary: str | None, sections: Sequence[Sequence[str]]
) -> str:
    """The header of an RSE segment: the document line, then the section, or the sections in
    order when the segment spans several (at most :data:`MAX_SEGMENT_SECTIONS`).
    """
    named = dict.fromkeys(section_label(path) for path in sections)  # in order, once each
    labels = [label for label in named if label and label != (title or "")]
    document = compose_header(title, summary)
    lines = [document] if document else []
    if len(labels) == 1:
        lines.append(f"Section: {labels[0]}")
    elif labels:
        shown = labels[:MAX_SEGMENT_SECTIONS]
        more = len(labels) - len(shown)
        lines.append("Sections: " + "; ".join(shown) + (f"; and {more} more" if more else ""))
    return "\n".join(lines)


def _line(kind: str, title: str | None, summary: str | None) -> str:
    head = f"{kind}: {title}" if title else f"{kind}:"
    if not summary:
        return head
    joiner = " " if not title or title.rstrip()[-1:] in ".!?:" else ". "  # no second full stop
    return head + joiner + summary.strip()
