"""Sections of a document as line and character ranges (pure Python, no LlamaIndex).

Both sectioning strategies end here: the headings strategy and the LLM strategy each produce the
first line and the title of every section, and :func:`sections_from_starts` turns those into
ranges that cover the document exactly once, in order.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Section:
    """Lines ``[start_line, end_line)`` and characters ``[start_char, end_char)`` of a document.

    ``title`` names the section itself; ``path`` holds the titles from the outermost enclosing
    section down to this one (the document's own title left out), so a subsection reads
    ``("The match statement", "OR Patterns")``. Text before the first heading has an empty path.
    """

    title: str
    path: tuple[str, ...]
    start_line: int
    end_line: int
    start_char: int
    end_char: int


@dataclass(frozen=True)
class SectionStart:
    """Where a section begins: its first line, its title and its path (see :class:`Section`)."""

    line: int
    title: str
    path: tuple[str, ...] = field(default=())


class LineIndex:
    """A text's lines (ended by ``\\n``, or by a ``\\r`` not before one) and where each starts."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = re.split(r"\n|\r(?!\n)", text)
        self.starts = [0, *itertools.accumulate(len(line) + 1 for line in self.lines[:-1])]

    def __len__(self) -> int:
        return len(self.lines)

    def char(self, line: int) -> int:
        """Offset of the first character of ``line`` (``len(text)`` past the last line)."""
        return self.starts[line] if line < len(self.starts) else len(self.text)

    def is_blank(self, line: int) -> bool:
        return not self.lines[line].strip()


def sections_from_starts(index: LineIndex, starts: Sequence[SectionStart]) -> list[Section]:
    """Sections that begin at ``starts`` and each run to the next start (the last one to the end).

    Starts are sorted and deduplicated by line; text before the first start becomes an untitled
    section when it is not blank. Sections that hold nothing but blank lines are dropped, and a
    section holding only its heading (a heading directly followed by another) is merged into the
    section after it, so no chunk is a bare heading.
    """
    by_line: dict[int, SectionStart] = {}
    for start in sorted(starts, key=lambda s: s.line):
        if 0 <= start.line < len(index) and start.line not in by_line:
            by_line[start.line] = start
    ordered = list(by_line.values())
    if not ordered or ordered[0].line > 0:
        ordered.insert(0, SectionStart(0, "", ()))
    sections: list[Section] = []
    for i, start in enumerate(ordered):
        end_line = ordered[i + 1].line if i + 1 < len(ordered) else len(index)
        sections.append(
            Section(
                title=start.title,
                path=tuple(start.path),
                start_line=start.line,
                end_line=end_line,
                start_char=index.char(start.line),
                end_char=index.char(end_line) if end_line < len(index) else len(index.text),
            )
        )
    return _merge_bare(index, [s for s in sections if _has_text(index, s)])


def _has_text(index: LineIndex, section: Section) -> bool:
    return any(not index.is_blank(i) for i in range(section.start_line, section.end_line))


def _merge_bare(index: LineIndex, sections: list[Section]) -> list[Section]:
    """Merge sections whose only text is their heading into the next section."""
    merged: list[Section] = []
    carry: Section | None = None
    for i, section in enumerate(sections):
        if carry is not None:
            section = replace(section, start_line=carry.start_line, start_char=carry.start_char)
            carry = None
        if i + 1 < len(sections) and section.title:
            # At most a heading and its underline (or an ATX heading): nothing to chunk.
            body = [
                index.lines[j]
                for j in range(section.start_line, section.end_line)
                if not index.is_blank(j)
            ]
            if len(body) == 1 or (len(body) == 2 and _is_adornment(body[1])):
                carry = section
                continue
        merged.append(section)
    return merged


def _is_adornment(line: str) -> bool:
    stripped = line.strip()
    return len(stripped) >= 3 and len(set(stripped)) == 1 and not stripped[0].isalnum()
