"""The structural strategy: which lines are headings, and the sections they delimit."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from llama_index.packs.self_rag_rse.context.headings import find_headings, heading_sections

CORPUS = Path(__file__).resolve().parents[2] / "examples" / "data" / "python_reference"


def test_markdown_headings_levels_and_paths(markdown: str) -> None:
    headings = find_headings(markdown)
    assert [(h.title, h.level) for h in headings] == [
        ("Field guide to herons", 1),
        ("Habitat", 2),
        ("Diet", 2),
        ("Fish", 3),
        ("Other prey", 3),
    ]  # the "# not a heading" comment sits in a fenced block
    sections, title = heading_sections(markdown)
    assert title == "Field guide to herons"
    assert [s.path for s in sections] == [
        (),
        ("Habitat",),
        ("Diet", "Fish"),  # "Diet" holds only its heading: merged into its first child
        ("Diet", "Other prey"),
    ]
    assert sections[0].title == "Field guide to herons"


def test_sections_cover_the_text_in_order(markdown: str) -> None:
    sections, _ = heading_sections(markdown)
    assert sections[0].start_char == 0
    assert sections[-1].end_char == len(markdown)
    for before, after in itertools.pairwise(sections):
        assert before.end_char == after.start_char
        assert before.end_line == after.start_line
    assert markdown[sections[1].start_char :].startswith("## Habitat")


def test_rest_underlines_overlines_and_levels_by_first_appearance() -> None:
    text = (
        "=====\nGuide\n=====\n\nIntro text.\n\nPart one\n--------\n\nBody one.\n\n"
        "Detail\n~~~~~~\n\nMore.\n\nPart two\n--------\n\nBody two.\n"
    )
    headings = find_headings(text)
    assert [(h.title, h.level) for h in headings] == [
        ("Guide", 1),
        ("Part one", 2),
        ("Detail", 3),
        ("Part two", 2),
    ]
    assert headings[0].first_line == 0 and headings[0].last_line == 2  # overline + underline
    sections, title = heading_sections(text)
    assert title == "Guide"
    assert [s.path for s in sections] == [(), ("Part one",), ("Part one", "Detail"), ("Part two",)]


@pytest.mark.parametrize(
    "text",
    [
        "Some prose that runs on\nand ends here\n---\n\nMore prose.\n",  # a rule under prose
        "+------+------+\n| a    | b    |\n|======|======|\n| 1    | 2    |\n",  # a table
        "Intro.\n\n   indented code\n   =============\n",  # indented: code, not a heading
        "A very long line of ordinary prose that goes on and on\n~~~~\n",  # short reST underline
    ],
)
def test_what_is_not_a_heading(text: str) -> None:
    assert find_headings(text) == []


def test_numbered_headings_need_two_and_prose_after_them() -> None:
    text = (
        "1 Introduction\n\nWhy we wrote this.\n\n2 Method\n\nHow we did it.\n\n"
        "2.1 Sampling\n\nWho we asked.\n"
    )
    assert [(h.title, h.level) for h in find_headings(text)] == [
        ("1 Introduction", 1),
        ("2 Method", 1),
        ("2.1 Sampling", 2),
    ]
    assert find_headings(text, numbered=False) == []
    # A list: each item is followed by the next item, and one candidate alone is not enough.
    assert find_headings("Steps:\n\n1. Install\n\n2. Configure\n\n3. Run\n") == []
    assert find_headings("1 Introduction\n\nOnly one numbered line here.\n") == []


def test_unclosed_fence_fences_nothing() -> None:
    text = "```\nstray fence\n\n# Real heading\n\nText.\n"
    assert [h.title for h in find_headings(text)] == ["Real heading"]


def test_shipped_chapter_sections() -> None:
    text = (CORPUS / "compound.txt").read_text()
    sections, title = heading_sections(text)
    assert title == "Compound statements"
    labels = [" > ".join(s.path) for s in sections]
    assert 'The "try" statement > "except" clause' in labels
    assert 'The "match" statement > Patterns > OR Patterns' in labels
    assert sections[-1].end_char == len(text)
    assert all(a.end_char == b.start_char for a, b in itertools.pairwise(sections))


def test_windows_line_endings_and_text_without_headings() -> None:
    text = "Guide\r\n=====\r\n\r\nIntro.\r\n\r\n## Part\r\n\r\nBody.\r\n"
    assert [h.title for h in find_headings(text)] == ["Guide", "Part"]
    # Old Mac text ends its lines with \r alone: the same headings, the same sections' offsets.
    mac, unix = text.replace("\r\n", "\r"), text.replace("\r\n", "\n")
    assert [h.title for h in find_headings(mac)] == ["Guide", "Part"]
    mac_spans, unix_spans = (
        [(s.path, s.start_char, s.end_char) for s in heading_sections(t)[0]] for t in (mac, unix)
    )
    assert mac_spans == unix_spans and len(mac_spans) == 2
    sections, title = heading_sections("Just prose.\n\nMore prose.\n")
    assert title is None
    assert [(s.title, s.path, s.start_char, s.end_char) for s in sections] == [("", (), 0, 25)]


@pytest.mark.parametrize("text", ["\ufeff# Title\n\nBody.\n", "\ufeffTitle\n=====\n\nBody.\n"])
def test_a_byte_order_mark_does_not_hide_the_title_heading(text: str) -> None:
    # A file read as UTF-8 (not utf-8-sig) starts with U+FEFF: the title heading was not found,
    # and the header fell back to the file name.
    sections, title = heading_sections(text)
    assert title == "Title"
    assert sections[-1].end_char == len(text) and sections[0].start_char == 0
