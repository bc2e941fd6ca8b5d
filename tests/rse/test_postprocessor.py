"""RelevantSegmentPostprocessor end to end: real corpus, MiniLM, Qdrant local mode, no docstore."""

from __future__ import annotations

import asyncio
import itertools
import warnings

import pytest
from corpus import CORPUS, corpus_documents, qdrant_index
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeRelationship, NodeWithScore, RelatedNodeInfo, TextNode
from llama_index.core.storage.docstore import SimpleDocumentStore

from llama_index.packs.self_rag_rse import ChunkIndexer, RelevantSegmentPostprocessor

QUERY = 'The "while" statement: loop while an expression is true, else clause, break, continue'


def source_text(doc_id: str) -> str:
    return (CORPUS / f"{doc_id}.txt").read_text()


def same_but_whitespace(a: str, b: str) -> bool:
    return len(a) == len(b) and all(
        x == y or (x.isspace() and y.isspace()) for x, y in zip(a, b, strict=True)
    )


def assert_exact_segments(result: list[NodeWithScore]) -> None:
    assert result, "expected at least one segment"
    scores = [r.score for r in result]
    assert scores == sorted(scores, reverse=True)
    for item in result:
        meta = item.node.metadata
        text = source_text(meta["segment_document_id"])
        start, end = meta["segment_char_range"]
        # The segment is the source span: no duplicated overlap, no lost text, true offsets.
        # Only whitespace the splitter stripped between two chunks is refilled by guess.
        assert same_but_whitespace(item.node.get_content(), text[start:end])
        first, last = meta["segment_chunk_range"]
        assert last - first == len(meta["segment_node_ids"])
        assert item.score == pytest.approx(meta["segment_value"])


@pytest.fixture(scope="module")
def indexed(corpus_nodes, minilm):
    return qdrant_index(corpus_nodes, minilm, collection="indexed")


@pytest.fixture(scope="module")
def unindexed(corpus_nodes, minilm):
    return qdrant_index(corpus_nodes, minilm, keep_chunk_index=False, collection="plain")


def test_chunk_indexer_numbers_each_document_in_order(corpus_nodes):
    by_doc: dict[str, list] = {}
    for node in corpus_nodes:
        by_doc.setdefault(node.ref_doc_id, []).append(node)
    for nodes in by_doc.values():
        ordered = sorted(nodes, key=lambda n: n.metadata["chunk_index"])
        assert [n.metadata["chunk_index"] for n in ordered] == list(range(len(nodes)))
        starts = [n.start_char_idx for n in ordered]
        assert starts == sorted(starts)
        assert "chunk_index" in nodes[0].excluded_embed_metadata_keys
        assert "chunk_index" in nodes[0].excluded_llm_metadata_keys


def test_qdrant_with_chunk_index_reads_only_gaps_in_one_call(indexed):
    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    rse = RelevantSegmentPostprocessor(vector_store=indexed.vector_store)
    extraction = rse.extract(retrieved)
    assert extraction.store_calls <= 1
    result = rse.postprocess_nodes(retrieved, query_str=QUERY)
    assert_exact_segments(result)
    best = result[0].node
    assert best.metadata["segment_document_id"] == "compound"
    assert 'The "while" statement' in best.get_content()
    # The segment is longer than any retrieved chunk: it joined chunks.
    assert len(best.metadata["segment_node_ids"]) > 1


def test_qdrant_without_chunk_index_orders_by_reading_documents(indexed, unindexed):
    retrieved = unindexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    rse = RelevantSegmentPostprocessor(index=unindexed)
    extraction = rse.extract(retrieved)
    assert extraction.store_calls == 1  # one filtered read of the hit documents
    result = rse.postprocess_nodes(retrieved, query_str=QUERY)
    assert_exact_segments(result)
    # Same segments as the chunk-indexed store gives.
    with_index = RelevantSegmentPostprocessor(index=indexed).postprocess_nodes(
        indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    )
    assert [r.node.metadata["segment_chunk_range"] for r in result] == [
        r.node.metadata["segment_chunk_range"] for r in with_index
    ]
    assert [r.node.get_content() for r in result] == [r.node.get_content() for r in with_index]


def test_docstore_index_reads_gaps_by_id(corpus_nodes, minilm):
    nodes = [n.model_copy(deep=True) for n in corpus_nodes]
    for node in nodes:
        node.metadata.pop("chunk_index")
    index = VectorStoreIndex(nodes, embed_model=minilm)  # SimpleVectorStore + docstore
    retrieved = index.as_retriever(similarity_top_k=10).retrieve(QUERY)
    rse = RelevantSegmentPostprocessor(index=index)
    extraction = rse.extract(retrieved)
    assert extraction.store_calls <= 2  # document records, then one read of the gaps
    assert_exact_segments(rse.postprocess_nodes(retrieved))


def test_inside_retriever_query_engine(indexed):
    rse = RelevantSegmentPostprocessor(index=indexed)
    engine = RetrieverQueryEngine.from_args(
        indexed.as_retriever(similarity_top_k=10), llm=MockLLM(), node_postprocessors=[rse]
    )
    response = engine.query(QUERY)
    assert_exact_segments(response.source_nodes)
    assert "segment_node_ids" not in response.source_nodes[0].node.get_content(metadata_mode="llm")


def test_output_chunks_returns_members_in_document_order(indexed):
    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    segments = RelevantSegmentPostprocessor(index=indexed).postprocess_nodes(retrieved)
    chunks = RelevantSegmentPostprocessor(index=indexed, output="chunks").postprocess_nodes(
        retrieved
    )
    expected = [i for s in segments for i in s.node.metadata["segment_node_ids"]]
    assert [c.node.node_id for c in chunks] == expected


def test_async_matches_sync_on_async_qdrant(corpus_nodes):
    from llama_index.core.vector_stores.types import VectorStoreQuery
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import AsyncQdrantClient

    async def run():
        store = QdrantVectorStore(
            aclient=AsyncQdrantClient(location=":memory:"), collection_name="async"
        )
        await store.async_add([n.model_copy(deep=True) for n in corpus_nodes])
        query_node = next(n for n in corpus_nodes if 'The "while" statement' in n.get_content())
        found = await store.aquery(
            VectorStoreQuery(query_embedding=query_node.embedding, similarity_top_k=10)
        )
        retrieved = [
            NodeWithScore(node=n, score=s)
            for n, s in zip(found.nodes, found.similarities, strict=True)
        ]
        rse = RelevantSegmentPostprocessor(vector_store=store)
        return await rse.apostprocess_nodes(retrieved, query_str=QUERY), rse.extract

    result, _ = asyncio.run(run())
    assert_exact_segments(result)
    assert 'The "while" statement' in result[0].node.get_content()


def test_emits_rerank_events(indexed, events):
    retrieved = indexed.as_retriever(similarity_top_k=5).retrieve(QUERY)
    RelevantSegmentPostprocessor(index=indexed).postprocess_nodes(retrieved)
    assert "ReRankStartEvent" in events and "ReRankEndEvent" in events


# -- bad and unusual input ---------------------------------------------------------------------


def make_doc_nodes(doc_id: str, n: int, *, indexed: bool = True, text_len: int = 20):
    """n consecutive chunks of a synthetic document with exact character offsets."""
    nodes = []
    for i in range(n):
        text = f"{doc_id}-{i:06d}".ljust(text_len, ".")
        node = TextNode(
            id_=f"{doc_id}-{i}",
            text=text,
            start_char_idx=i * text_len,
            end_char_idx=(i + 1) * text_len,
            relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id=doc_id)},
        )
        if indexed:
            node.metadata["chunk_index"] = i
        nodes.append(node)
    for a, b in itertools.pairwise(nodes):
        a.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=b.node_id)
        b.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=a.node_id)
    return nodes


def docstore_with(nodes) -> SimpleDocumentStore:
    store = SimpleDocumentStore()
    store.add_documents(nodes)
    for node in nodes:  # what an index's docstore records per document
        info = store.get_ref_doc_info(node.ref_doc_id)
        assert info is not None
    return store


def test_empty_input_returns_empty():
    assert RelevantSegmentPostprocessor().postprocess_nodes([]) == []


def test_single_node_without_store_is_its_own_segment():
    node = make_doc_nodes("solo", 1)[0]
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
        [NodeWithScore(node=node, score=0.9)]
    )
    assert len(result) == 1
    assert result[0].node.get_content() == node.text
    assert result[0].score == pytest.approx(0.9 - 0.18)


def test_no_store_joins_only_retrieved_adjacent_chunks():
    nodes = make_doc_nodes("doc", 10)
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in (2, 3, 4, 7)]
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(hits)
    ranges = [r.node.metadata["segment_chunk_range"] for r in result]
    assert [2, 5] in ranges  # 2,3,4 joined
    assert all(not (a < 6 < b) for a, b in ranges)  # never across the unread chunks 5, 6


def test_docstore_fills_gap_between_hits():
    nodes = make_doc_nodes("doc", 10)
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in (2, 4)]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    result = rse.postprocess_nodes(hits)
    assert result[0].node.metadata["segment_chunk_range"] == [2, 5]
    assert result[0].node.get_content() == "".join(n.text for n in nodes[2:5])


def test_none_and_negative_scores():
    nodes = make_doc_nodes("doc", 6)
    store = docstore_with(nodes)
    rse = RelevantSegmentPostprocessor(docstore=store)
    # No scores at all: ranks alone decide; a contiguous run of hits becomes one segment.
    result = rse.postprocess_nodes([NodeWithScore(node=n, score=None) for n in nodes[1:4]])
    assert result[0].node.metadata["segment_chunk_range"] == [1, 4]
    # Negative similarities mean irrelevant: nothing clears the minimum value.
    negative = [NodeWithScore(node=n, score=-0.3) for n in nodes[1:4]]
    assert rse.postprocess_nodes(negative) == []
    # Mixed: a warning says how missing scores were treated.
    mixed = [NodeWithScore(node=nodes[1], score=0.9), NodeWithScore(node=nodes[2], score=None)]
    with pytest.warns(UserWarning, match="no score"):
        rse.postprocess_nodes(mixed)


def test_nan_score_is_an_error():
    node = make_doc_nodes("doc", 1)[0]
    with pytest.raises(ValueError, match="NaN"):
        RelevantSegmentPostprocessor().postprocess_nodes(
            [NodeWithScore(node=node, score=float("nan"))]
        )


def test_many_documents_and_one_chunk_documents():
    nodes = []
    hits = []
    for d in range(15):
        doc = make_doc_nodes(f"d{d}", 1 if d % 2 else 4)
        nodes += doc
        hits += [NodeWithScore(node=n, score=0.95 - 0.01 * d) for n in doc]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    extraction = rse.extract(hits)
    # Only the documents of the top-10 hits are searched (dsRAG's document selection).
    assert len({r.doc_id for r in extraction.regions}) <= 10
    result = rse.postprocess_nodes(hits)
    total = sum(len(r.node.metadata["segment_node_ids"]) for r in result)
    assert total <= 30
    for r in result:
        doc_id = r.node.metadata["segment_document_id"]
        a, b = r.node.metadata["segment_chunk_range"]
        assert r.node.get_content() == "".join(
            f"{doc_id}-{i:06d}".ljust(20, ".") for i in range(a, b)
        )


def test_huge_document_reads_only_what_segments_need():
    from llama_index.core.vector_stores import SimpleVectorStore

    nodes = make_doc_nodes("huge", 100_000)
    by_index = {n.metadata["chunk_index"]: n for n in nodes}
    hit_ids = (10, 12, 50_000, 99_990, 99_991)
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in hit_ids]
    requests = []

    class IndexedStore(SimpleVectorStore):
        """A store of 100k chunks that answers chunk-index filters (a real store's API)."""

        def get_nodes(self, node_ids=None, filters=None, limit=None):
            requests.append(filters)
            wanted = [i for sub in filters.filters for i in sub.filters[1].value]
            return [by_index[i] for i in wanted]

    rse = RelevantSegmentPostprocessor(vector_store=IndexedStore(), calibration="raw")
    extraction = rse.extract(hits)
    ranges = sorted([s.start, s.end] for s in extraction.segments)
    assert [10, 13] in ranges and [99_990, 99_992] in ranges
    assert extraction.store_calls == 1
    (only,) = requests
    assert [sub.filters[1].value for sub in only.filters] == [[11]]  # the one gap needed


def test_unknown_preset_and_bad_lengths():
    with pytest.raises(ValueError, match="balanced"):
        RelevantSegmentPostprocessor(preset="fast")
    with pytest.raises(ValueError, match="max_length"):
        RelevantSegmentPostprocessor(max_length=0)
    with pytest.raises(ValueError, match="calibration"):
        RelevantSegmentPostprocessor(calibration="softmax")


def test_nodes_without_source_pass_through_or_raise():
    orphan = NodeWithScore(node=TextNode(text="orphan"), score=0.5)
    placed = make_doc_nodes("doc", 1)[0]
    items = [orphan, NodeWithScore(node=placed, score=0.9)]
    with pytest.warns(UserWarning, match="no source document"):
        result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(items)
    assert result[-1] is orphan
    with pytest.raises(ValueError, match="no source document"):
        RelevantSegmentPostprocessor(on_unplaceable="raise").postprocess_nodes(items)


def test_nodes_that_nothing_orders_pass_through_unchanged():
    bare = [
        NodeWithScore(
            node=TextNode(
                id_=f"bare-{i}",
                text=f"chunk {i}",
                relationships={NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc")},
            ),
            score=0.9,
        )
        for i in range(2)
    ]
    with pytest.warns(UserWarning, match="no chunk index, offsets"):
        result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(bare)
    assert result == bare
    with pytest.raises(ValueError, match="Fix:"):
        RelevantSegmentPostprocessor(on_unplaceable="raise").postprocess_nodes(bare)


def test_store_that_cannot_read_gaps_degrades_without_skipping_text(indexed, caplog):
    from llama_index.vector_stores.qdrant import QdrantVectorStore

    class NoReads(QdrantVectorStore):
        def get_nodes(self, *args, **kwargs):
            raise NotImplementedError("this store cannot read nodes back")

    store = indexed.vector_store
    broken = NoReads(client=store.client, collection_name=store.collection_name)
    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    with caplog.at_level("WARNING"):
        result = RelevantSegmentPostprocessor(vector_store=broken).postprocess_nodes(retrieved)
    assert "could not read" in caplog.text and "Fix:" in caplog.text
    retrieved_ids = {r.node.node_id for r in retrieved}
    for item in result:
        # Every member was retrieved: nothing between hits was invented or skipped.
        assert set(item.node.metadata["segment_node_ids"]) <= retrieved_ids
    assert_exact_segments(result)


def test_plot_segments_writes_png(indexed, tmp_path):
    from llama_index.packs.self_rag_rse import plot_segments

    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    extraction = RelevantSegmentPostprocessor(index=indexed).extract(retrieved)
    path = plot_segments(extraction, tmp_path / "rse.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5_000


def test_warnings_are_not_raised_for_clean_input(indexed):
    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RelevantSegmentPostprocessor(index=indexed).postprocess_nodes(retrieved)


def test_documents_helper_round_trip():
    docs = corpus_documents(("execmodel",))
    nodes = ChunkIndexer()(
        __import__("llama_index.core.node_parser", fromlist=["SentenceSplitter"])
        .SentenceSplitter(chunk_size=64, chunk_overlap=0)
        .get_nodes_from_documents(docs)
    )
    hits = [NodeWithScore(node=n, score=0.9) for n in nodes[3:9]]
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(hits)
    text = docs[0].text
    start, end = result[0].node.metadata["segment_char_range"]
    # Without overlap the splitter strips whitespace between chunks: the stitched text keeps
    # every non-space character and the exact offsets.
    assert result[0].node.get_content().split() == text[start:end].split()
    assert len(result[0].node.get_content()) == end - start
