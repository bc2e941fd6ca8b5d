"""The words of chunk and segment headers."""

from __future__ import annotations

from llama_index.packs.self_rag_rse.context.compose import (
    compose_header,
    compose_segment_header,
    section_label,
)


def test_chunk_header_shapes() -> None:
    assert (
        compose_header("Herons", None, ("Diet", "Fish")) == "Document: Herons\nSection: Diet > Fish"
    )
    assert compose_header("Herons") == "Document: Herons"
    assert compose_header("Herons", "This document covers herons.", ()) == (
        "Document: Herons. This document covers herons."
    )
    assert compose_header("Herons?", "It does.", ("Diet",), "This section is about food.") == (
        "Document: Herons? It does.\nSection: Diet. This section is about food."
    )
    assert compose_header("", None, ()) == ""
    # A section that only repeats the document title adds nothing.
    assert compose_header("Herons", None, ("Herons",)) == "Document: Herons"


def test_segment_header_names_every_section_once() -> None:
    paths = [("Diet", "Fish"), ("Diet", "Fish"), ("Diet", "Other prey")]
    assert compose_segment_header("Herons", None, paths) == (
        "Document: Herons\nSections: Diet > Fish; Diet > Other prey"
    )
    assert compose_segment_header("Herons", None, paths[:1]) == (
        "Document: Herons\nSection: Diet > Fish"
    )
    many = [(f"S{i}",) for i in range(6)]
    assert compose_segment_header("T", None, many).endswith("S3; and 2 more")
    assert section_label(["A", "", "B"]) == "A > B"
