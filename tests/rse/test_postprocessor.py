"""RelevantSegmentPostprocessor end to end: real corpus, MiniLM, Qdrant local mode, no docstore."""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import warnings

import numpy as np
import pytest
from corpus import CORPUS, corpus_documents
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core import VectorStoreIndex
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import NodeRelationship, NodeWithScore, RelatedNodeInfo, TextNode
from text_strategies import SEPARATORS, WORDS, same_but_whitespace

from llama_index.packs.self_rag_rse import (
    ChunkIndexer,
    RelevantSegmentPostprocessor,
    SegmentExtraction,
)
from llama_index.packs.self_rag_rse.rse.types import Segment

QUERY = 'The "while" statement: loop while an expression is true, else clause, break, continue'


def source_text(doc_id: str) -> str:
    return (CORPUS / f"{doc_id}.txt").read_text()


def assert_true_text(result: list[NodeWithScore], text: str) -> None:
    """Every node reporting a character range holds exactly that span of ``text`` (only
    whitespace a splitter stripped may differ in kind), and no node holds text ``text`` lacks.
    """
    for item in result:
        node = item.node
        char_range = node.metadata["segment_char_range"]
        if char_range is not None:
            start, end = char_range
            assert same_but_whitespace(node.get_content(), text[start:end])
            assert (node.start_char_idx, node.end_char_idx) == (start, end)
        squeezed = " ".join(node.get_content().split())
        assert squeezed in " ".join(text.split())


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


def test_stable_ids_read_the_gaps_by_id_with_the_same_result(indexed, corpus_nodes, minilm):
    from corpus import qdrant_index

    nodes = ChunkIndexer(stable_ids=True)([n.model_copy(deep=True) for n in corpus_nodes])
    stable = qdrant_index(nodes, minilm, collection="stable")
    expected = RelevantSegmentPostprocessor(vector_store=indexed.vector_store).postprocess_nodes(
        indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    )
    store = stable.vector_store
    rse = RelevantSegmentPostprocessor(vector_store=store)
    retrieved = stable.as_retriever(similarity_top_k=10).retrieve(QUERY)
    # Qdrant local mode answers a filtered scroll by scanning every point: with stable ids the
    # chunks between hits are read by id, and no scroll happens.
    scrolls: list[object] = []
    client = store.client
    real_scroll = client.scroll
    client.scroll = lambda *a, **k: scrolls.append(k) or real_scroll(*a, **k)
    try:
        extraction = rse.extract(retrieved)
        result = rse.postprocess_nodes(retrieved, query_str=QUERY)
    finally:
        client.scroll = real_scroll
    assert scrolls == [] and extraction.store_calls == 1 and not extraction.holes
    assert [r.node.get_content() for r in result] == [e.node.get_content() for e in expected]
    assert [r.node.metadata["segment_chunk_range"] for r in result] == [
        e.node.metadata["segment_chunk_range"] for e in expected
    ]
    assert_exact_segments(result)


def test_chunks_without_their_stable_id_are_read_by_index(doc_nodes):
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    from llama_index.packs.self_rag_rse.rse.chunk_index import stable_chunk_id

    nodes = ChunkIndexer(stable_ids=True)(doc_nodes("doc", 6))
    assert nodes[1].node_id == stable_chunk_id("doc", 1)
    # The hits carry stable ids; the chunks between them were ingested another way.
    for i in (2, 3):
        nodes[i].node_id = f"00000000-0000-4000-8000-00000000000{i}"
    for left, right in itertools.pairwise(nodes):
        left.relationships[NodeRelationship.NEXT] = RelatedNodeInfo(node_id=right.node_id)
        right.relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=left.node_id)
    for node in nodes:
        node.embedding = [1.0, 0.0]
    hits = [nodes[1], nodes[4]]
    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="mixed")
    store.add(nodes)
    rse = RelevantSegmentPostprocessor(vector_store=store, calibration="raw")
    extraction = rse.extract([NodeWithScore(node=n, score=0.9) for n in hits])
    assert extraction.store_calls == 2 and not extraction.holes  # by id, then by index
    (segment,) = rse.postprocess_nodes([NodeWithScore(node=n, score=0.9) for n in hits])
    assert segment.node.metadata["segment_chunk_range"] == [1, 5]
    assert segment.node.get_content() == "".join(n.text for n in nodes[1:5])


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


def test_an_index_filled_after_the_postprocessor_was_built_is_read(corpus_nodes, minilm):
    # The usual start-up order: an empty index, the postprocessor, then the documents. RSE used
    # to decide on the docstore when it was built (empty then: never read), so every query
    # read the gaps from a SimpleVectorStore that cannot, and the segments lost them.
    index = VectorStoreIndex([], embed_model=minilm)  # SimpleVectorStore + docstore
    rse = RelevantSegmentPostprocessor(index=index)
    index.insert_nodes([n.model_copy(deep=True) for n in corpus_nodes])
    retrieved = index.as_retriever(similarity_top_k=10).retrieve(QUERY)
    hit_ids = {hit.node.node_id for hit in retrieved}
    members = [m.node_id for s in rse.extract(retrieved).segments for m in s.members]
    assert set(members) - hit_ids  # chunks between the hits, read from the docstore
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


def test_empty_input_returns_empty():
    assert RelevantSegmentPostprocessor().postprocess_nodes([]) == []


def test_a_generator_of_hits_gives_what_the_list_gives(doc_nodes, docstore_with):
    nodes = doc_nodes("doc", 6)
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in (1, 3)]
    expected = [r.node.get_content() for r in rse.postprocess_nodes(list(hits))]
    assert expected  # the start event once used the generator up: [] came back
    assert [r.node.get_content() for r in rse.postprocess_nodes(h for h in hits)] == expected
    again = asyncio.run(rse.apostprocess_nodes(h for h in hits))
    assert [r.node.get_content() for r in again] == expected


def test_a_node_given_twice_is_ranked_by_its_best_score(doc_nodes, docstore_with):
    """Two retrievers' lists joined: the weaker copy of the top hit came first and was kept, so
    RSE dropped the top hit (only chunk 4 came back).
    """
    nodes = doc_nodes("doc", 10)
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    hits = [NodeWithScore(node=nodes[2], score=0.9), NodeWithScore(node=nodes[4], score=0.8)]
    expected = [(r.node.get_content(), r.score) for r in rse.postprocess_nodes(hits)]
    assert "doc-000002" in expected[0][0]
    for weak in (0.1, None):
        joined = [NodeWithScore(node=nodes[2], score=weak), *hits]
        got = [(r.node.get_content(), r.score) for r in rse.postprocess_nodes(joined)]
        assert got == expected
        again = asyncio.run(rse.apostprocess_nodes(joined))
        assert [(r.node.get_content(), r.score) for r in again] == expected


def test_single_node_without_store_is_its_own_segment(doc_nodes):
    node = doc_nodes("solo", 1)[0]
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
        [NodeWithScore(node=node, score=0.9)]
    )
    assert len(result) == 1
    assert result[0].node.get_content() == node.text
    assert result[0].score == pytest.approx(0.9 - 0.18)


def test_no_store_joins_only_retrieved_adjacent_chunks(doc_nodes):
    nodes = doc_nodes("doc", 10)
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in (2, 3, 4, 7)]
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(hits)
    ranges = [r.node.metadata["segment_chunk_range"] for r in result]
    assert [2, 5] in ranges  # 2,3,4 joined
    assert all(not (a < 6 < b) for a, b in ranges)  # never across the unread chunks 5, 6


def test_docstore_fills_gap_between_hits(doc_nodes, docstore_with):
    nodes = doc_nodes("doc", 10)
    hits = [NodeWithScore(node=nodes[i], score=0.9) for i in (2, 4)]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    result = rse.postprocess_nodes(hits)
    assert result[0].node.metadata["segment_chunk_range"] == [2, 5]
    assert result[0].node.get_content() == "".join(n.text for n in nodes[2:5])


def test_default_calibration_keeps_strong_hits_apart(doc_nodes, docstore_with):
    # Similarities above cosine_range's top (0.5): the fixed 'cosine' range counts both hits
    # fully relevant (values differ only by rank); the default stretches the range to 0.75.
    nodes = doc_nodes("doc", 10)
    hits = [NodeWithScore(node=nodes[2], score=0.75), NodeWithScore(node=nodes[7], score=0.55)]
    store = docstore_with(nodes)
    adaptive = RelevantSegmentPostprocessor(docstore=store).extract(hits).values
    fixed = RelevantSegmentPostprocessor(docstore=store, calibration="cosine").extract(hits).values
    top, second = sorted(adaptive)[-1], sorted(adaptive)[-2]
    assert top == sorted(fixed)[-1]  # the best hit is relevance 1 either way
    assert second < sorted(fixed)[-2]
    decay, penalty = 30.0, 0.18  # the balanced preset
    assert second == pytest.approx(math.exp(-1 / decay) * (0.55 - 0.1) / (0.75 - 0.1) - penalty)


def test_none_and_negative_scores(doc_nodes, docstore_with):
    nodes = doc_nodes("doc", 6)
    store = docstore_with(nodes)
    rse = RelevantSegmentPostprocessor(docstore=store)
    # No scores at all: ranks alone decide; a contiguous run of hits becomes one segment.
    result = rse.postprocess_nodes([NodeWithScore(node=n, score=None) for n in nodes[1:4]])
    assert result[0].node.metadata["segment_chunk_range"] == [1, 4]
    # Negative similarities mean irrelevant: nothing clears the minimum value.
    negative = [NodeWithScore(node=n, score=-0.3) for n in nodes[1:4]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # irrelevant, not scores of another scale
        assert rse.postprocess_nodes(negative) == []
    # Mixed: a warning says how missing scores were treated.
    mixed = [NodeWithScore(node=nodes[1], score=0.9), NodeWithScore(node=nodes[2], score=None)]
    with pytest.warns(UserWarning, match="no score"):
        rse.postprocess_nodes(mixed)
    # The calibration sees the real scores only: an infinite one saturates at 1 without
    # stretching the adaptive range, and the missing one is not a stand-in score of 0.
    seen: list[list[float]] = []
    recording = RelevantSegmentPostprocessor(
        docstore=store, calibration=lambda s: seen.append(s.tolist()) or np.clip(s, 0, 1)
    )
    with pytest.warns(UserWarning, match="no score"):
        recording.postprocess_nodes(mixed)
    assert seen == [[0.9]]
    infinite = [NodeWithScore(node=nodes[1], score=math.inf), *mixed]
    with pytest.warns(UserWarning, match="no score"):
        values = rse.extract(infinite).values
    assert sorted(values)[-2] > 0.5  # 0.9 keeps most of its relevance next to the infinity


def test_an_infinite_relevance_is_an_error_naming_the_calibration(doc_nodes):
    nodes = doc_nodes("doc", 3)
    hits = [NodeWithScore(node=nodes[0], score=math.inf), NodeWithScore(node=nodes[2], score=0.4)]
    with pytest.raises(ValueError, match=r"calibration 'raw' left an infinite relevance"):
        RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(hits)
    # Calibrations that clip take it: the infinite score is fully relevant.
    (segment, *_) = RelevantSegmentPostprocessor().postprocess_nodes(hits)
    assert segment.node.get_content() == nodes[0].text


def test_nan_score_is_an_error(doc_nodes):
    node = doc_nodes("doc", 1)[0]
    with pytest.raises(ValueError, match="NaN"):
        RelevantSegmentPostprocessor().postprocess_nodes(
            [NodeWithScore(node=node, score=float("nan"))]
        )


def test_many_documents_and_one_chunk_documents(doc_nodes, docstore_with):
    nodes = []
    hits = []
    for d in range(15):
        doc = doc_nodes(f"d{d}", 1 if d % 2 else 4)
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


def test_huge_document_reads_only_what_segments_need(doc_nodes):
    from llama_index.core.vector_stores import SimpleVectorStore

    nodes = doc_nodes("huge", 100_000)
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
    with pytest.raises(ValueError, match="calibration"):
        RelevantSegmentPostprocessor(calibration="softmax")


def test_nodes_without_source_pass_through_or_raise(doc_nodes):
    orphan = NodeWithScore(node=TextNode(text="orphan"), score=0.5)
    placed = doc_nodes("doc", 1)[0]
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


def test_warnings_are_not_raised_for_clean_input(indexed):
    retrieved = indexed.as_retriever(similarity_top_k=10).retrieve(QUERY)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = RelevantSegmentPostprocessor(index=indexed).postprocess_nodes(retrieved)
    # Quiet because nothing went wrong, not because nothing came back: the ten hits (all of
    # "compound", the best its chunks 8 and 9) give two segments, best first, each the exact
    # span of the document.
    assert_exact_segments(result)
    assert len(result) == 2
    assert [item.node.metadata["segment_document_id"] for item in result] == ["compound"] * 2
    best_hits = [hit.node.metadata["chunk_index"] for hit in retrieved[:2]]
    first, last = result[0].node.metadata["segment_chunk_range"]
    assert all(first <= index < last for index in best_hits)
    assert last - first > len(best_hits)  # joined with chunks nobody retrieved
    assert 'The "while" statement' in result[0].node.get_content()
    second_start, _ = result[1].node.metadata["segment_chunk_range"]
    assert second_start > last  # apart from the first: segments never touch


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


def test_the_public_name_is_the_result_type():
    import llama_index.packs.self_rag_rse as pack

    assert pack.SegmentExtraction is SegmentExtraction
    assert type(pack.RelevantSegmentPostprocessor().extract([])) is SegmentExtraction


# -- options: misspelt and non-finite values are errors ------------------------------------------


def test_unknown_option_names_itself_and_the_closest_valid_one():
    with pytest.raises(TypeError, match="irrelevant_chunk_penality") as error:
        RelevantSegmentPostprocessor(irrelevant_chunk_penality=0.3)
    assert "did you mean 'irrelevant_chunk_penalty'" in str(error.value)
    with pytest.raises(TypeError, match="did you mean 'docstore'"):
        RelevantSegmentPostprocessor(doc_store=None)


@pytest.mark.parametrize(
    ("option", "value", "named"),
    [
        ("minimum_value", math.nan, "minimum_value"),
        ("irrelevant_chunk_penalty", math.inf, "irrelevant_chunk_penalty"),
        ("decay_rate", -math.inf, "decay_rate"),
        ("cosine_range", (math.nan, 0.5), "cosine_range"),
        ("cosine_range", (0.1, math.inf), "cosine_range"),
    ],
)
def test_non_finite_options_are_errors(option, value, named):
    with pytest.raises(ValueError, match=named):
        RelevantSegmentPostprocessor(**{option: value})


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_length", 0, "max_length must be a positive integer"),
        ("max_length", True, "max_length must be a positive integer, got True"),
        ("overall_max_length", False, "overall_max_length must be a positive integer"),
        ("top_k_for_document_selection", -1, "top_k_for_document_selection must be"),
        ("max_document_chunks", True, "max_document_chunks must be a positive integer"),
        ("preset", "fast", "balanced"),
        ("calibration", "softmax", "calibration"),
        ("minimum_value", math.nan, "minimum_value"),
        ("cosine_range", (0.5, 0.1), "cosine_range"),
    ],
)
def test_options_are_checked_when_set_after_construction(option, value, message):
    rse = RelevantSegmentPostprocessor()
    with pytest.raises(ValueError, match=message):
        setattr(rse, option, value)
    with pytest.raises(ValueError, match=message):
        RelevantSegmentPostprocessor(**{option: value})


def test_a_valid_option_set_after_construction_takes_effect(doc_nodes, docstore_with):
    nodes = doc_nodes("d", 8)
    hits = [NodeWithScore(node=n, score=0.9) for n in nodes]
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    assert [(s.start, s.end) for s in rse.extract(hits).segments] == [(0, 8)]
    rse.max_length = 3
    assert all(s.end - s.start <= 3 for s in rse.extract(hits).segments)


def test_segment_ids_name_what_they_hold(doc_nodes):
    """Without a store, positions come from links among one call's hits (every call numbers
    from 0); a segment's id still names its chunks: different chunks, different ids; the same
    chunks, the same id on every call.
    """
    nodes = doc_nodes("d", 12, indexed=False)
    rse = RelevantSegmentPostprocessor(calibration="raw")

    def ids(*picks: int) -> list[str]:
        hits = [NodeWithScore(node=nodes[i], score=0.9) for i in picks]
        return [item.node.node_id for item in rse.postprocess_nodes(hits)]

    early, late = ids(3, 4), ids(10, 11)
    assert len(early) == len(late) == 1 and early != late
    assert ids(3, 4) == early
    assert set(ids(3, 4, 10, 11)) == {*early, *late}


def test_nan_score_next_to_a_missing_score_is_an_error(doc_nodes):
    nodes = doc_nodes("doc", 2)
    items = [NodeWithScore(node=nodes[0], score=None), NodeWithScore(node=nodes[1], score=math.nan)]
    with pytest.raises(ValueError, match="NaN"):
        RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(items)


# -- holes in a document's order -----------------------------------------------------------------


def hits_on(nodes, *which, score=0.9):
    return [NodeWithScore(node=nodes[i], score=score) for i in which]


def test_docstore_with_a_deleted_chunk_splits_the_segment_there(split, docstore_with, caplog):
    nodes = split(64, 0)  # no chunk index: the docstore's record orders the document
    store = docstore_with(nodes)
    store.delete_document(nodes[3].node_id)  # also drops it from the document's record
    rse = RelevantSegmentPostprocessor(docstore=store, calibration="raw")
    with caplog.at_level(logging.WARNING):
        result = rse.postprocess_nodes(hits_on(nodes, 2, 4))
    assert caplog.text.count("hole") >= 1 and "Fix:" in caplog.text
    member_sets = [set(r.node.metadata["segment_node_ids"]) for r in result]
    assert {nodes[2].node_id} in member_sets and {nodes[4].node_id} in member_sets
    assert all(nodes[3].get_content()[:40] not in r.node.get_content() for r in result)
    assert_true_text(result, source_text("execmodel"))
    # The chunk before the hole keeps its true index; past the hole it is not known for sure.
    ranges = {r.node.metadata["segment_node_ids"][0]: r.node.metadata for r in result}
    assert ranges[nodes[2].node_id]["segment_chunk_range"] == [2, 3]
    extraction = rse.extract(hits_on(nodes, 2, 4))
    assert extraction.holes and "lacks" in extraction.holes[0].reason


def test_deleted_chunk_found_by_offsets_alone(split, docstore_with):
    nodes = [n.model_copy(deep=True) for n in split(64, 0)]
    for node in nodes:  # no links: only the offsets can tell
        node.relationships.pop(NodeRelationship.NEXT, None)
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
    store = docstore_with(nodes)
    store.delete_document(nodes[3].node_id)
    rse = RelevantSegmentPostprocessor(docstore=store, calibration="raw")
    result = rse.postprocess_nodes(hits_on(nodes, 2, 4))
    assert all(len(r.node.metadata["segment_node_ids"]) == 1 for r in result)
    assert_true_text(result, source_text("execmodel"))
    assert any("gap" in h.reason for h in rse.extract(hits_on(nodes, 2, 4)).holes)


def test_deleted_chunk_between_two_hits_read_back_is_not_joined(split, docstore_with):
    # Chunk 4 is gone; the hits (2 and 6) do not touch it, so only chunks read back show it.
    nodes = split(64, 0)
    store = docstore_with(nodes)
    store.delete_document(nodes[4].node_id)
    rse = RelevantSegmentPostprocessor(
        docstore=store, calibration="raw", irrelevant_chunk_penalty=0.05
    )
    result = rse.postprocess_nodes(hits_on(nodes, 2, 6, score=1.0))
    assert result
    for item in result:
        ids = item.node.metadata["segment_node_ids"]
        assert not (nodes[3].node_id in ids and nodes[5].node_id in ids)
    assert_true_text(result, source_text("execmodel"))


@pytest.mark.parametrize("shift", [-20, 20, 200])
@pytest.mark.parametrize("overlap", [0, 24])
def test_wrong_offsets_never_drop_or_invent_text(split, docstore_with, shift, overlap):
    nodes = [n.model_copy(deep=True) for n in split(96, overlap)]
    k = 5
    nodes[k].start_char_idx += shift  # wrong but length-consistent, in the store and the hits
    nodes[k].end_char_idx += shift
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    result = rse.postprocess_nodes(hits_on(nodes, k - 1, k, k + 1))
    text = source_text("execmodel")
    assert_true_text(result, text)
    joined = " ".join(" ".join(r.node.get_content().split()) for r in result)
    for node in nodes[k - 1 : k + 2]:  # nothing dropped
        assert " ".join(node.get_content().split()) in joined
    for item in result:  # no range for text placed by the wrong chunk's offsets
        if nodes[k].node_id in item.node.metadata["segment_node_ids"]:
            assert item.node.metadata["segment_char_range"] is None


def test_segment_split_at_a_hole_found_only_when_stitching(doc_nodes):
    from llama_index.packs.self_rag_rse.rse.segment_nodes import segment_nodes

    members = doc_nodes("doc", 4)
    for node in members[2:]:  # text of 30 characters between chunks 1 and 2 that no chunk has
        node.start_char_idx += 30
        node.end_char_idx += 30
    for node in members:
        node.relationships.pop(NodeRelationship.NEXT, None)
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
    parts = segment_nodes(Segment("doc", 0, 4, 2.0, members, (0, 4)))
    assert [p.metadata["segment_node_ids"] for p in parts] == [
        ["doc-0", "doc-1"],
        ["doc-2", "doc-3"],
    ]
    assert [p.metadata["segment_chunk_range"] for p in parts] == [[0, 2], [2, 4]]
    assert [p.metadata["segment_char_range"] for p in parts] == [[0, 40], [70, 110]]
    assert parts[1].get_content() == "doc-000002..........doc-000003.........."
    assert "gap" in parts[0].metadata["segment_breaks"][0]


def test_links_only_positions_report_no_chunk_range(split):
    nodes = split(64, 0)
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(hits_on(nodes, 2, 3))
    (only,) = result
    assert only.node.metadata["segment_node_ids"] == [nodes[2].node_id, nodes[3].node_id]
    assert only.node.metadata["segment_chunk_range"] is None  # not the renumbered [0, 2]


def test_links_only_positions_report_stamped_indices(split):
    nodes = [n.model_copy(deep=True) for n in split(64, 0)]
    ChunkIndexer()(nodes)
    del nodes[9].metadata["chunk_index"]  # one hit unstamped: order comes from links
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
        hits_on(nodes, 2, 3, 9)
    )
    ranges = {tuple(r.node.metadata["segment_node_ids"]): r for r in result}
    joined = ranges[(nodes[2].node_id, nodes[3].node_id)]
    assert joined.node.metadata["segment_chunk_range"] == [2, 4]
    assert ranges[(nodes[9].node_id,)].node.metadata["segment_chunk_range"] is None


# -- an empty answer says why ---------------------------------------------------------------------


def test_nothing_worth_minimum_value_is_explained(doc_nodes, docstore_with, caplog):
    nodes = doc_nodes("doc", 6)
    rse = RelevantSegmentPostprocessor(docstore=docstore_with(nodes), calibration="raw")
    weak = hits_on(nodes, 1, 3, score=0.5)  # 0.5 - 0.18 each, never joined: 0.32 < 0.5
    with caplog.at_level(logging.INFO):
        assert rse.postprocess_nodes(weak) == []
    notes = [r for r in caplog.records if "RSE kept none" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelno == logging.INFO
    note = rse.extract(weak).note
    assert note is not None
    assert "of 2 nodes" in note and "best segment value 0.444 < minimum_value 0.5" in note
    assert "lower minimum_value or irrelevant_chunk_penalty" in note
    negative = rse.extract(hits_on(nodes, 1, score=-0.3))
    assert negative.note is not None and "irrelevant_chunk_penalty 0.18" in negative.note
    assert rse.extract(hits_on(nodes, 1, 2, 3)).note is None  # segments found: nothing to say
    assert rse.extract([]).note is None


# -- any text, any splitter setting: segments are the source text ----------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    words=st.lists(
        st.tuples(st.sampled_from(WORDS), st.sampled_from(SEPARATORS)), min_size=3, max_size=150
    ),
    chunk_size=st.sampled_from([16, 24, 40]),
    overlap=st.sampled_from([0, 2, 5, 12]),  # 12: chunks i and i + 2 overlap at size 16 and 24
    stable=st.booleans(),
    picks=st.lists(st.tuples(st.integers(0, 10**6), st.floats(-0.3, 1.0)), max_size=12),
)
def test_segments_are_the_source_text_for_any_text(words, chunk_size, overlap, stable, picks):
    """Each segment's text is the document's at its range, and no character is given twice."""
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore

    text = "".join(w + sep for w, sep in words)
    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=overlap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "metadata length close to chunk size"
        nodes = splitter.get_nodes_from_documents([Document(text=text, id_="doc")])
    if not nodes:  # whitespace only: nothing to retrieve
        return
    ChunkIndexer(stable_ids=stable)(nodes)
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    hits = {nodes[i % len(nodes)].node_id: (nodes[i % len(nodes)], s) for i, s in picks}
    scored = [NodeWithScore(node=n, score=s) for n, s in hits.values()]
    rse = RelevantSegmentPostprocessor(docstore=docstore, calibration="raw")
    ranges = []
    for item in rse.postprocess_nodes(scored):
        char_range = item.node.metadata["segment_char_range"]
        if char_range is not None:
            start, end = char_range
            assert same_but_whitespace(item.node.get_content(), text[start:end])
            ranges.append((start, end))
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(sorted(ranges)))


@pytest.mark.parametrize("budget", [None, 1000])
def test_segments_that_do_not_touch_give_shared_text_once(budget):
    """A splitter overlap above half a chunk makes chunks 0 and 2 overlap: two segments that do
    not touch shared text, given twice. The later one now starts where the earlier ends.
    """
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.storage.docstore import SimpleDocumentStore

    text = " ".join(f"w{i:02d}" for i in range(60))
    nodes = SentenceSplitter(chunk_size=24, chunk_overlap=16).get_nodes_from_documents(
        [Document(text=text, id_="doc")]
    )
    ChunkIndexer(stable_ids=True)(nodes)
    assert nodes[2].start_char_idx < nodes[0].end_char_idx  # the premise
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    rse = RelevantSegmentPostprocessor(
        docstore=docstore, calibration="raw", max_length=1, max_context_chars=budget
    )
    hits = [NodeWithScore(node=nodes[0], score=0.9), NodeWithScore(node=nodes[2], score=0.8)]
    out = sorted(rse.postprocess_nodes(hits), key=lambda r: r.node.metadata["segment_char_range"])
    ranges = [r.node.metadata["segment_char_range"] for r in out]
    assert ranges == [[nodes[0].start_char_idx, nodes[0].end_char_idx],
                      [nodes[0].end_char_idx, nodes[2].end_char_idx]]  # fmt: skip
    joined = "".join(r.node.get_content() for r in out)
    assert joined == text[nodes[0].start_char_idx : nodes[2].end_char_idx]
    assert out[1].node.start_char_idx == nodes[0].end_char_idx


def test_bare_nodes_are_refused_before_cores_event_naming_the_fix(doc_nodes):
    """Core's ReRankStartEvent refused them with a pydantic error naming neither RSE nor the fix."""
    nodes = doc_nodes("doc", 3)
    rse = RelevantSegmentPostprocessor()
    message = r"got a TextNode.*NodeWithScore\(node=\.\.\., score=\.\.\.\)"
    with pytest.raises(TypeError, match=message):
        rse.postprocess_nodes([NodeWithScore(node=nodes[0], score=0.9), nodes[1]])
    with pytest.raises(TypeError, match=message):
        asyncio.run(rse.apostprocess_nodes(nodes))
    with pytest.raises(TypeError, match=message):
        rse.extract(nodes)
    with pytest.raises(TypeError, match=r"got a NoneType.*NodeWithScore"):  # falsy items too
        rse.postprocess_nodes([NodeWithScore(node=nodes[0], score=0.9), None])


def test_scores_below_the_cosine_range_say_which_calibration_fits(split):
    # Reciprocal-rank fusion (QueryFusionRetriever, the hybrid-search recipe) scores about
    # 1/(60 + rank): every hit was worth 0, the query engine said "Empty Response", and only an
    # INFO line told why.
    nodes = ChunkIndexer()(split(64, 0))
    hits = [NodeWithScore(node=nodes[i], score=1 / (61 + r)) for r, i in enumerate((3, 4, 9))]
    with pytest.warns(UserWarning, match="calibration='spread'"):
        assert RelevantSegmentPostprocessor().postprocess_nodes(hits) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = RelevantSegmentPostprocessor(calibration="spread").postprocess_nodes(hits)
    assert kept and nodes[3].text in kept[0].node.get_content()
