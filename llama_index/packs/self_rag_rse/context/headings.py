"""Find a document's headings without a model: Markdown, reST/pydoc underlines, numbered titles.

The structural sectioning strategy: free, offline and deterministic. Recognised, always at the
start of a line (indented lines are code or quotes, never headings):

- Markdown ATX headings, ``# Title`` to ``###### Title`` (not inside fenced code blocks);
- underlined headings (Markdown setext, reStructuredText, pydoc text): a title line followed by
  a line of one repeated punctuation character, optionally with an overline too. The title must
  open a block (a blank line or the start of the text before it), which keeps a ``---`` rule
  under a paragraph from becoming a heading;
- numbered headings, ``2.1 Scope`` or ``3. Results``: a short capitalised line standing alone
  between blank lines, accepted only when the document has at least two of them and only when
  ``numbered=True``.

Levels follow reStructuredText: each underline style (character, with or without overline) gets
the next level the first time it appears. ATX headings take their number of ``#``; numbered ones
the number of their parts. A heading that opens the document (nothing but blank lines before it)
in a style used only once is the document's title: it is reported separately and left out of
section paths.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llama_index.packs.self_rag_rse.context.sections import (
    LineIndex,
    Section,
    SectionStart,
    sections_from_starts,
)

_ATX = re.compile(r"^(#{1,6})[ \t]+(.*?)[ \t#]*\r?$")
_ADORNMENT = re.compile(r"^([!-/:-@\[-`{-~])\1{2,}\s*$")
_NUMBERED = re.compile(r"^(\d{1,3}(?:\.\d{1,3})*)\.?[ \t]+(\S.*?)\s*$")
_FENCE = re.compile(r"^(`{3,}|~{3,})")
#: Longest line taken for a title: anything longer is prose.
MAX_TITLE_CHARS = 160
MAX_NUMBERED_TITLE_CHARS = 80


@dataclass(frozen=True)
class Heading:
    """A heading: its title, level (1 = outermost) and lines ``[first_line, last_line]``
    (``first_line`` is the overline when there is one; ``last_line`` the underline).
    """

    title: str
    level: int
    first_line: int
    last_line: int
    kind: str  # "atx", "underline" or "numbered"


def find_headings(text: str, *, numbered: bool = True) -> list[Heading]:
    """Every heading of ``text``, in order (see the module docstring for what counts)."""
    index = LineIndex(text)
    lines = [line.removeprefix("\ufeff") for line in index.lines]  # a byte-order mark hides none
    in_code = _fenced_lines(lines)
    found: list[tuple[int, int, str, Any, str]] = []  # first, last, title, style or level, kind
    taken: set[int] = set()
    for i, line in enumerate(lines):
        if i in in_code or i in taken:
            continue
        atx = _ATX.match(line)
        if atx and _is_title(atx.group(2)):
            found.append((i, i, atx.group(2).strip(), len(atx.group(1)), "atx"))
            continue
        if i + 1 < len(lines) and (i + 1) not in in_code and _is_underlined(index, i):
            under = lines[i + 1].strip()
            over = i >= 1 and lines[i - 1].strip() == under and _opens_block(index, i - 1)
            if over or _opens_block(index, i):
                first = i - 1 if over else i
                found.append((first, i + 1, line.strip(), (under[0], over), "underline"))
                taken.update((i, i + 1))
    if numbered:
        candidates = [
            h for h in _numbered_headings(index, in_code) if not any(h[0] == f[0] for f in found)
        ]
        if len(candidates) >= 2:
            found.extend(candidates)
    found.sort(key=lambda h: h[0])
    levels: dict[object, int] = {}
    headings = []
    for first, last, title, style, kind in found:
        # ATX and numbered headings carry their level; each underline style gets the next one.
        level = levels.setdefault(style, len(levels) + 1) if kind == "underline" else style
        headings.append(Heading(title[:MAX_TITLE_CHARS], level, first, last, kind))
    return headings


def heading_sections(text: str, *, numbered: bool = True) -> tuple[list[Section], str | None]:
    """The sections the headings of ``text`` delimit, and the document's title heading if any.

    Each heading starts a section that runs to the next heading of any level; its path holds the
    titles of the headings above it (by level). Text before the first heading is an untitled
    section. The title heading, when there is one, is not part of any path: the section under it
    (the document's introduction) gets it as its title and an empty path.
    """
    index = LineIndex(text)
    headings = find_headings(text, numbered=numbered)
    doc_title: str | None = None
    if headings and _is_document_title(index, headings):
        doc_title = headings[0].title
    starts = []
    stack: list[Heading] = []
    for k, heading in enumerate(headings):
        if k == 0 and doc_title is not None:
            starts.append(SectionStart(heading.first_line, heading.title, ()))
            continue
        while stack and stack[-1].level >= heading.level:
            stack.pop()
        stack.append(heading)
        starts.append(
            SectionStart(heading.first_line, heading.title, tuple(h.title for h in stack))
        )
    return sections_from_starts(index, starts), doc_title


def _is_document_title(index: LineIndex, headings: list[Heading]) -> bool:
    first = headings[0]
    if any(not index.is_blank(i) for i in range(first.first_line)):
        return False
    # The first heading is the only one of its kind at its level or above.
    return len([h for h in headings if h.level <= first.level and h.kind == first.kind]) == 1


def _is_title(text: str) -> bool:
    stripped = text.strip()
    return 0 < len(stripped) <= MAX_TITLE_CHARS and any(c.isalnum() for c in stripped)


def _opens_block(index: LineIndex, line: int) -> bool:
    return line == 0 or index.is_blank(line - 1)


def _is_underlined(index: LineIndex, i: int) -> bool:
    """Whether line ``i`` is a title and line ``i + 1`` its underline."""
    title, under = index.lines[i : i + 2]
    match = _ADORNMENT.match(under)
    if not match or not _is_title(title) or title[0].isspace() or _ADORNMENT.match(title):
        return False
    if title.lstrip()[0] in "|+":  # a table row over a table rule
        return False
    length = len(under.strip())
    # Markdown setext headings take any length of = or -; reST wants the line under the
    # whole title, and an overlong title line is prose.
    return match.group(1) in "=-" or length >= len(title.strip()) // 2


def _fenced_lines(lines: list[str]) -> set[int]:
    """Lines inside Markdown fenced code blocks. An opening fence that never closes fences
    nothing (it was a stray line, not a fence).
    """
    inside: set[int] = set()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        # A fence opens a block; a ~~~ right under a text line is an underline instead.
        if match and (i == 0 or not lines[i - 1].strip()):
            marker = match.group(1)
            for j in range(i + 1, len(lines)):
                if (
                    lines[j].strip().startswith(marker[0] * len(marker))
                    and not lines[j].strip(marker[0]).strip()
                ):
                    inside.update(range(i, j + 1))
                    i = j
                    break
        i += 1
    return inside


def _numbered_headings(
    index: LineIndex, in_code: set[int]
) -> list[tuple[int, int, str, object, str]]:
    lines = index.lines
    out: list[tuple[int, int, str, object, str]] = []
    for i, line in enumerate(lines):
        if i in in_code:
            continue
        match = _NUMBERED.match(line)
        if not match:
            continue
        title = match.group(2)
        next_blank = i + 1 >= len(lines) or index.is_blank(i + 1)
        if (
            _opens_block(index, i)
            and next_blank
            and len(line.strip()) <= MAX_NUMBERED_TITLE_CHARS
            and title[0].isupper()
            and title[-1] not in ".,;:?!"
            and _followed_by_text(index, i)
        ):
            out.append((i, i, line.strip(), len(match.group(1).split(".")), "numbered"))
    return out


def _followed_by_text(index: LineIndex, i: int) -> bool:
    """A numbered heading introduces prose; a list item is followed by the next item."""
    following = next((line for line in index.lines[i + 1 :] if line.strip()), None)
    return following is not None and not _NUMBERED.match(following)
