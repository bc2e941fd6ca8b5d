"""RSE segments carry their document/section header once, ahead of the exact span text."""

from __future__ import annotations

from typing import Any

from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeWithScore
from llama_index.core.storage.docstore import SimpleDocumentStore

from llama_index.packs.self_rag_rse import (
    ChunkIndexer,
    ContextualHeaders,
    DocumentSectioner,
    RelevantSegmentPostprocessor,
)
from llama_index.packs.self_rag_rse.context.segment_header import add_segment_header

#: Makes the Fish section several chunks long.
MORE = (
    "It swallows the catch whole. It hunts at dawn and at dusk, when the water is calm and "
    "the fish rise. Young herons learn by watching the adults of the colony. An adult heron "
    "may eat half a kilo of fish on a good day, and less in winter."
)


def _segments(
    markdown: str, hit_words: tuple[str, ...], **options: Any
) -> tuple[list[Any], dict[str, Any], str]:
    markdown = markdown.replace("It swallows the catch whole.", MORE)
    doc = Document(text=markdown, id_="herons")
    splitter = SentenceSplitter(chunk_size=50, chunk_overlap=0)
    chunks = ContextualHeaders()(ChunkIndexer()(DocumentSectioner(splitter=splitter)([doc])))
    docstore = SimpleDocumentStore()
    docstore.add_documents(chunks)
    hits = [NodeWithScore(node=c, score=0.9) for c in chunks if any(w in c.text for w in hit_words)]
    rse = RelevantSegmentPostprocessor(docstore=docstore, irrelevant_chunk_penalty=0.0, **options)
    return rse.postprocess_nodes(hits), {c.node_id: c for c in chunks}, markdown


def test_a_segment_starts_with_its_header_once(markdown: str) -> None:
    segments, _, text = _segments(markdown, ("grey heron", "half a kilo"))
    node = segments[0].node
    header = "Document: Field guide to herons\nSection: Diet > Fish"
    shown = node.get_content(MetadataMode.LLM)
    assert shown.startswith(header + "\n\n")
    assert shown.count("Document:") == 1  # not once per chunk
    assert len(node.metadata["segment_node_ids"]) >= 2
    start, end = node.metadata["segment_char_range"]
    assert node.get_content(MetadataMode.NONE) == text[start:end]  # the span, untouched


def test_segment_headers_false_shows_the_text_only_and_a_budget_pays_no_header(
    markdown: str,
) -> None:
    words = ("grey heron", "half a kilo")
    (shown,), _, _ = _segments(markdown, words)
    (bare,), _, text = _segments(markdown, words, segment_headers=False)
    start, end = bare.node.metadata["segment_char_range"]
    assert bare.node.get_content(MetadataMode.LLM) == text[start:end]
    assert "segment_header" not in bare.node.metadata
    assert shown.node.metadata["segment_char_range"] == [start, end]
    # A budget of exactly the text holds the bare segment whole; with its header it cannot.
    budget = {"max_context_chars": end - start}
    (fits,), _, _ = _segments(markdown, words, segment_headers=False, **budget)
    assert fits.node.metadata["segment_char_range"] == [start, end]
    with_header, _, _ = _segments(markdown, words, **budget)
    assert all(len(r.node.get_content(MetadataMode.LLM)) <= end - start for r in with_header)
    assert [r.node.metadata["segment_char_range"] for r in with_header] != [[start, end]]


def test_a_segment_across_sections_names_them_all(markdown: str) -> None:
    segments, chunks, _ = _segments(markdown, ("marshes", "colonies", "Diet", "grey heron"))
    node = segments[0].node
    assert node.metadata["segment_header"] == (
        "Document: Field guide to herons\nSections: Habitat; Diet > Fish"
    )
    # Computing it again from the members gives the same node (the RSE wiring is idempotent).
    members = [chunks[i] for i in node.metadata["segment_node_ids"]]
    before = node.get_content(MetadataMode.LLM)
    assert add_segment_header(node, members).get_content(MetadataMode.LLM) == before


def test_segments_of_chunks_without_headers_are_unchanged(markdown: str) -> None:
    doc = Document(text=markdown, id_="plain")
    chunks = SentenceSplitter(chunk_size=50, chunk_overlap=0).get_nodes_from_documents([doc])
    node = chunks[0].model_copy()
    assert add_segment_header(node, chunks[:1]) is node
    assert "segment_header" not in node.metadata


def test_arrays_and_numbers_in_header_metadata_are_not_header_text() -> None:
    import numpy as np
    from llama_index.core.schema import TextNode

    from llama_index.packs.self_rag_rse.context.keys import (
        DOCUMENT_SUMMARY_KEY,
        DOCUMENT_TITLE_KEY,
        SECTION_PATH_KEY,
    )
    from llama_index.packs.self_rag_rse.context.segment_header import segment_header

    odd = TextNode(
        text="x",
        metadata={
            DOCUMENT_TITLE_KEY: np.array([1.0, 2.0]),
            DOCUMENT_SUMMARY_KEY: float("nan"),
            SECTION_PATH_KEY: np.array(["a", "b"]),
        },
    )
    assert segment_header(odd, [odd]) == ""
    titled = TextNode(text="y", metadata={DOCUMENT_TITLE_KEY: "Guide", SECTION_PATH_KEY: ["Intro"]})
    header = segment_header(titled, [titled, odd])
    assert "Guide" in header and "Intro" in header
