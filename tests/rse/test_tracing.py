"""RSE in LlamaIndex instrumentation: its spans (the postprocess call, the extraction, each store
read) inside a core ``RetrieverQueryEngine`` on Qdrant local mode, and its event: the hits in,
the segments out, what a context budget dropped or refilled, why nothing came back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeWithScore
from traces import openinference, otel_tree, recorded

from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor, SegmentsExtractedEvent

QUERY = 'The "while" statement: loop while an expression is true, else clause, break, continue'


def rse_part(tree: list[str]) -> list[str]:
    """The lines of the tree from RSE's postprocess span on, as deep as they are."""
    at = next(i for i, line in enumerate(tree) if "RelevantSegmentPostprocessor" in line)
    depth = len(tree[at]) - len(tree[at].lstrip())
    part = [tree[at][depth:]]
    for line in tree[at + 1 :]:
        if len(line) - len(line.lstrip()) <= depth:
            break
        part.append(line[depth:])
    return part


def test_inside_a_retriever_query_engine(indexed: Any) -> None:
    rse = RelevantSegmentPostprocessor(index=indexed)
    engine = RetrieverQueryEngine.from_args(
        indexed.as_retriever(similarity_top_k=10), llm=MockLLM(), node_postprocessors=[rse]
    )
    with recorded() as record:
        response = engine.query(QUERY)
    assert rse_part(record.tree()) == [
        "RelevantSegmentPostprocessor._postprocess_nodes",
        "  RelevantSegmentPostprocessor.extract",
        "    ChunkSource.run",
    ]
    (event,) = record.of(SegmentsExtractedEvent)
    assert record.span_of(event) == "RelevantSegmentPostprocessor.extract"
    assert len(event.hits) == 10 and event.hits[0].score >= event.hits[-1].score
    # The segments handed on are the engine's sources, best first, with their text's size.
    sources = response.source_nodes
    assert [row["doc_id"] for row in event.segments] == [
        s.node.metadata["segment_document_id"] for s in sources
    ]
    assert [row["value"] for row in event.segments] == [s.score for s in sources]
    assert [row["characters"] for row in event.segments] == [
        len(s.node.get_content(metadata_mode="llm")) for s in sources
    ]
    # With no tokenizer, tokens as RSE estimates them: one per four characters.
    assert all(row["tokens"] >= row["characters"] / 4 > 0 for row in event.segments)
    first, last = event.segments[0]["chunks"]
    assert last - first == len(sources[0].node.metadata["segment_node_ids"])
    assert event.dropped == event.refilled == [] and event.extraction.note is None


def test_async_reads_are_spans_too(doc_nodes: Any, docstore_with: Any) -> None:
    nodes = doc_nodes("d", 8)
    hits = [NodeWithScore(node=nodes[i], score=0.9 - i / 100) for i in (1, 3)]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    with recorded() as record:
        asyncio.run(rse.apostprocess_nodes(hits, query_str=QUERY))
    (event,) = record.of(SegmentsExtractedEvent)
    reads = event.extraction.store_calls
    assert reads == 2  # the document's node ids, then the chunk between the hits
    assert rse_part(record.tree()) == [
        "RelevantSegmentPostprocessor._apostprocess_nodes",
        "  RelevantSegmentPostprocessor.aextract",
        *["    ChunkSource.arun"] * reads,
    ]
    assert event.segments[0]["chunks"] == (1, 4)


def test_what_a_budget_dropped_and_refilled(doc_nodes: Any, docstore_with: Any) -> None:
    """A segment header far denser in tokens than its chunk (priced at the chunk's tokens per
    character) makes the nodes built overrun the limit: the budget drops the segments and
    refills with the hits that fit alone (as in test_budget_postprocessor.py).
    """
    from llama_index.packs.self_rag_rse.context.keys import DOCUMENT_TITLE_KEY

    titled = doc_nodes("t", 1, text_len=100)
    nodes = doc_nodes("d", 6, text_len=100)
    for node in [*titled, *nodes]:
        node.set_content("y" * 100)
    titled[0].metadata[DOCUMENT_TITLE_KEY] = "x" * 80
    titled[0].excluded_llm_metadata_keys = [DOCUMENT_TITLE_KEY]

    def tokens(text: str) -> list[str]:
        return [c for c in text if c == "x"] + ["y"] * (text.count("y") // 50)

    hits = [NodeWithScore(node=titled[0], score=0.9)]
    hits += [NodeWithScore(node=nodes[i], score=s) for i, s in ((2, 0.5), (4, 0.45))]
    rse = RelevantSegmentPostprocessor(
        docstore=docstore_with([*titled, *nodes]),
        calibration="raw",
        max_context_tokens=60,
        tokenizer=tokens,
    )
    with recorded() as record:
        result = rse.postprocess_nodes(hits)
    (event,) = record.of(SegmentsExtractedEvent)
    assert event.dropped and event.refilled
    assert [s.members[0].node_id for s in event.refilled] == [
        n.node.metadata["segment_node_ids"][0] for n in result
    ]
    assert all(any(s is d for d in event.searched) for s in event.dropped)
    # Each segment's size as the budget counts it: its text's tokens by the tokenizer given.
    assert [row["tokens"] for row in event.segments] == [
        len(tokens(n.node.get_content(metadata_mode="llm"))) for n in result
    ]


def test_why_nothing_came_back(doc_nodes: Any, docstore_with: Any) -> None:
    nodes = doc_nodes("d", 4)
    hits = [NodeWithScore(node=nodes[1], score=0.1)]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    with recorded() as record:
        assert rse.postprocess_nodes(hits) == []
    (event,) = record.of(SegmentsExtractedEvent)
    assert event.segments == [] and event.extraction.note.startswith("RSE kept none of 1 nodes")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_openinference_shows_the_reads_inside_the_extraction(indexed: Any) -> None:
    rse = RelevantSegmentPostprocessor(index=indexed)
    engine = RetrieverQueryEngine.from_args(
        indexed.as_retriever(similarity_top_k=10), llm=MockLLM(), node_postprocessors=[rse]
    )
    with openinference() as exporter:
        engine.query(QUERY)
    spans = exporter.get_finished_spans()
    assert rse_part(otel_tree(spans)) == [
        "RelevantSegmentPostprocessor._postprocess_nodes",
        "  RelevantSegmentPostprocessor.extract",
        "    ChunkSource.run",
    ]
    (postprocess,) = [s for s in spans if s.name.endswith("_postprocess_nodes")]
    assert postprocess.attributes["openinference.span.kind"] == "RERANKER"
    (extract,) = [s for s in spans if s.name == "RelevantSegmentPostprocessor.extract"]
    assert '"segments"' in extract.attributes["output.value"]
