"""Checking and repairing an LLM's partition of numbered lines; windows and stitching."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llama_index.packs.self_rag_rse.context.partition import (
    PartitionError,
    plan_next_window,
    render_window,
    repair_partition,
    window_end,
)
from llama_index.packs.self_rag_rse.context.sections import LineIndex, SectionStart

TEXT = "\n".join(f"line {i} of the text" if i % 5 else "" for i in range(40))
INDEX = LineIndex(TEXT)


def test_an_exact_partition_needs_no_repair() -> None:
    fixed = repair_partition([("A", 10, 19), ("B", 20, 29)], INDEX, 10, 29)
    assert [(s.line, s.title) for s in fixed.starts] == [(10, "A"), (20, "B")]
    assert fixed.repairs == []


def test_repairs_order_duplicates_window_start_and_overlaps() -> None:
    proposed = [("B", 20, 35), ("A", 12, 22), ("dup", 20, 25), ("outside", 50, 60)]
    fixed = repair_partition(proposed, INDEX, 10, 29)
    assert [(s.line, s.title) for s in fixed.starts] == [(10, "A"), (20, "B")]
    text = " | ".join(fixed.repairs)
    for expected in ("outside", "sorted", "duplicate", "moved the first section", "overlaps"):
        assert expected in text


def test_blank_titles_are_named_by_their_first_words() -> None:
    fixed = repair_partition([("", 10, 19), ('  "B"  ', 20, 29)], INDEX, 10, 29)
    assert [s.title for s in fixed.starts] == ["line 11 of the text", "B"]


def test_nothing_inside_the_window_is_rejected_with_the_window_named() -> None:
    with pytest.raises(PartitionError, match=r"doc\.md, window lines 10-29: .*no section"):
        repair_partition([("A", 0, 5)], INDEX, 10, 29, window_name="doc.md, window lines 10-29")


def test_a_line_by_line_answer_is_rejected() -> None:
    proposed = [(f"S{i}", i, i) for i in range(10, 30)]
    with pytest.raises(PartitionError, match="listed lines, not sections"):
        repair_partition(proposed, INDEX, 10, 29, min_lines=3)


def test_short_sections_merge_into_the_next_one() -> None:
    fixed = repair_partition([("A", 10, 20), ("tiny", 21, 21), ("B", 22, 29)], INDEX, 10, 29)
    assert [(s.line, s.title) for s in fixed.starts] == [(10, "A"), (21, "B")]
    assert any("merged 1" in r for r in fixed.repairs)
    # The last section may be cut by the window's end: it is left for the next window.
    fixed = repair_partition([("A", 10, 28), ("end", 29, 29)], INDEX, 10, 29)
    assert [(s.line, s.title) for s in fixed.starts] == [(10, "A"), (29, "end")]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(max_size=8), st.integers(-5, 45), st.one_of(st.none(), st.integers())),
        max_size=12,
    )
)
def test_repaired_starts_always_partition_the_window(proposed) -> None:
    first, last = 10, 29
    try:
        fixed = repair_partition(proposed, INDEX, first, last, min_lines=1)
    except PartitionError:
        assert not any(first <= s <= last for _, s, _ in proposed)
        return
    lines = [s.line for s in fixed.starts]
    assert lines[0] == first
    assert lines == sorted(set(lines))
    assert all(first <= line <= last for line in lines)


def test_windows_render_numbered_non_blank_lines_within_budget() -> None:
    last = window_end(INDEX, 0, 100, 240)
    shown = render_window(INDEX, 0, last, 240)
    assert len(shown) <= 100
    assert shown.splitlines()[0] == "[1] line 1 of the text"  # line 0 is blank: not shown
    assert window_end(INDEX, 0, 1, 240) == 0  # at least one line
    long = LineIndex("x" * 500)
    assert render_window(long, 0, 0, 20) == "[0] " + "x" * 20 + "…"


def test_stitching_hands_the_last_section_to_the_next_window() -> None:
    starts = [SectionStart(10, "A"), SectionStart(20, "B")]
    assert plan_next_window(starts, 10, 29, 40) == (starts[:1], 20)
    assert plan_next_window(starts[:1], 10, 29, 40) == (starts[:1], 30)
    assert plan_next_window(starts, 10, 39, 40) == (starts, None)  # the document's end
