"""RelevantSegmentPostprocessor on stores that hold what they should not: two copies of a chunk,
two versions of a document, chunk indices that are no positions, odd metadata values.
"""

from __future__ import annotations

import logging
import math
import uuid
import warnings

import numpy as np
import pytest
from corpus import CORPUS
from llama_index.core import Document
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import NodeRelationship, NodeWithScore, RelatedNodeInfo

from llama_index.packs.self_rag_rse import ChunkIndexer, RelevantSegmentPostprocessor

BASE = (CORPUS / "execmodel.txt").read_text()


def versions(v1_text: str, v2_text: str, *, stable: bool = False, chunk_size: int = 64):
    """Document "doc" split and stamped twice: as ``v1_text``, then as ``v2_text``."""
    splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=0)
    out = []
    for text in (v1_text, v2_text):
        nodes = splitter.get_nodes_from_documents([Document(text=text, id_="doc")])
        out.append(ChunkIndexer(stable_ids=stable)(nodes))
    return out


def qdrant_with(nodes, name: str):
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name=name)
    copies = [n.model_copy(deep=True) for n in nodes]
    for node in copies:
        node.embedding = [1.0, 0.0]
    store.add(copies)
    return store


def scored(*pairs):
    return [NodeWithScore(node=node, score=score) for node, score in pairs]


def edited(text: str) -> str:
    """The same text with one word changed everywhere (same length: same chunk boundaries)."""
    return text.replace("the", "THE")


# -- item 2: two hits with one chunk index ---------------------------------------------------------


def test_two_hits_with_one_chunk_index_keep_both_texts_and_say_so(caplog):
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    assert v1[3].text != v2[3].text
    hits = scored((v2[3], 0.9), (v1[3], 0.85), (v2[5], 0.8))
    rse = RelevantSegmentPostprocessor(calibration="raw")
    with caplog.at_level(logging.WARNING), pytest.warns(UserWarning, match="claim the chunk"):
        result = rse.postprocess_nodes(hits)
    texts = [r.node.get_content() for r in result]
    for hit in (v2[3], v1[3], v2[5]):  # the best hit's text is not lost to the stale copy
        assert any(hit.text in text for text in texts)
    assert result[-1].node is v1[3]  # the extra passes through, after the segments
    with pytest.warns(UserWarning):
        extraction = rse.extract(hits)
    (conflict,) = [h for h in extraction.holes if h.left == h.right]
    assert conflict.left == 3 and v1[3].node_id in conflict.reason
    assert "claim chunk index 3" in caplog.text
    with pytest.raises(ValueError, match="claim the chunk index"):
        RelevantSegmentPostprocessor(calibration="raw", on_unplaceable="raise").extract(hits)


def test_one_id_given_to_two_texts_keeps_both_and_says_so():
    # Two chunkings of one document, both stamped ChunkIndexer(stable_ids=True), give chunk 3 of
    # each the same id with different texts (a chunk-size ensemble): RSE took them for one node
    # given twice and dropped the weaker one's text without a word.
    small, large = (versions(BASE, BASE, stable=True, chunk_size=size)[0] for size in (64, 256))
    assert small[3].node_id == large[3].node_id and small[3].text != large[3].text
    with pytest.warns(
        UserWarning, match=r"1 node\(s\) share their node id with a better-ranked"
    ) as caught:
        result = RelevantSegmentPostprocessor().postprocess_nodes(
            scored((small[3], 0.62), (large[3], 0.6))
        )
    # The fix for this cause: stable ids are what made the ids alike, so they are not advised.
    (message,) = [str(w.message) for w in caught if "share their node id" in str(w.message)]
    assert "Fix: give each chunking its own document ids" in message
    assert "add ChunkIndexer" not in message
    texts = " ".join(r.node.get_content() for r in result)
    assert small[3].text in texts and large[3].text in texts
    assert result[-1].node is large[3]  # passed through, after the segments


def test_chunks_read_back_for_one_index_are_told_apart_by_version(whitespace_equal):
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    store = qdrant_with(v1 + v2, "two-copies")  # a re-ingest without stable ids: both copies
    hits = scored((v2[3], 0.7), (v1[3], 0.65), (v2[5], 0.6))
    rse = RelevantSegmentPostprocessor(vector_store=store, calibration="raw")
    with pytest.warns(UserWarning, match="claim the chunk"):
        result = rse.postprocess_nodes(hits)
    best = result[0].node
    assert best.metadata["segment_node_ids"] == [v2[i].node_id for i in (3, 4, 5)]
    start, end = best.metadata["segment_char_range"]
    assert whitespace_equal(best.get_content(), edited(BASE[:3000])[start:end])


def test_unversioned_copies_read_back_for_one_index_are_a_hole():
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    for node in v1 + v2:  # copies from before versions were stamped, without document hashes
        del node.metadata["chunk_version"]  # or links that tell the copies apart
        node.relationships = {NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc")}
    store = qdrant_with(v1 + v2, "unversioned")
    assert v1[6].text != v2[6].text  # "the" became "THE" in it
    hits = scored((v2[5], 0.7), (v2[7], 0.6))
    rse = RelevantSegmentPostprocessor(vector_store=store, calibration="raw")
    extraction = rse.extract(hits)
    (hole,) = [h for h in extraction.holes if "2 different chunks at this position" in h.reason]
    assert (hole.left, hole.right) == (5, 7)
    for segment in extraction.segments:  # neither copy of chunk 6 joined the hits
        assert {m.node_id for m in segment.members} <= {v2[5].node_id, v2[7].node_id}
    # With the splitter's links, the copy linked to the hits is the one.
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    for node in v1 + v2:
        del node.metadata["chunk_version"]
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="doc")
    store = qdrant_with(v1 + v2, "linked")
    rse = RelevantSegmentPostprocessor(vector_store=store, calibration="raw")
    (best, *_) = rse.extract(scored((v2[5], 0.7), (v2[7], 0.6))).segments
    assert [m.node_id for m in best.members] == [v2[i].node_id for i in (5, 6, 7)]


def test_chunks_of_two_chunkings_of_one_version_are_never_joined():
    # The same document re-ingested with a larger chunk size keeps its version and overwrites
    # its first chunks (stable ids), not the rest: chunk 11 of the new chunking was joined to
    # chunks 12 and 13 of the old one, text from the middle of the document after its end.
    text = BASE[:3000]
    old, new = (
        ChunkIndexer(stable_ids=True)(
            SentenceSplitter(chunk_size=size, chunk_overlap=0).get_nodes_from_documents(
                [Document(text=text, id_="doc")]
            )
        )
        for size in (48, 160)
    )
    assert len(old) > len(new) + 2
    store = qdrant_with(old + new, "two-chunkings")  # the new chunks overwrite the first ids
    hits = scored((new[-1], 0.9), (old[len(new) + 1], 0.8))
    extraction = RelevantSegmentPostprocessor(vector_store=store, calibration="raw").extract(hits)
    assert any("starts at character" in hole.reason for hole in extraction.holes)
    for segment in RelevantSegmentPostprocessor(vector_store=store).postprocess_nodes(hits):
        assert segment.node.get_content() in text


# -- item 3: stable ids and a shorter new version --------------------------------------------------


def test_chunks_of_two_versions_are_never_joined(whitespace_equal):
    old_text, new_text = BASE[:6000], edited(BASE[:3000])
    v1, v2 = versions(old_text, new_text, stable=True)
    assert len(v1) > len(v2) + 4
    n = len(v2)
    # Ingest v1, then v2 over it: v2 overwrites chunks 0..n-1, v1's tail stays, its first chunk
    # linked PREVIOUS to the stable id v2's last chunk now has.
    store = qdrant_with(v1, "versions")
    store.add([node.model_copy(update={"embedding": [1.0, 0.0]}) for node in v2])
    assert v1[n].relationships[NodeRelationship.PREVIOUS].node_id == v2[-1].node_id
    hits = scored((v2[-2], 0.8), (v1[n], 0.75), (v1[n + 1], 0.7))
    rse = RelevantSegmentPostprocessor(vector_store=store, calibration="raw")
    result = rse.postprocess_nodes(hits)
    old_ids, new_ids = {x.node_id for x in v1[n:]}, {x.node_id for x in v2}
    for item in result:
        members = set(item.node.metadata["segment_node_ids"])
        assert members <= old_ids or members <= new_ids
        text = new_text if members <= new_ids else old_text
        start, end = item.node.metadata["segment_char_range"]
        assert end <= len(text) and whitespace_equal(item.node.get_content(), text[start:end])
    holes = rse.extract(hits).holes
    assert any("different versions" in h.reason for h in holes)


def test_two_versions_read_from_the_store_are_not_interleaved(whitespace_equal):
    # No chunk index: the order comes from reading the document's nodes back; both versions'
    # copies are there, one at every offset.
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    for node in v1 + v2:
        del node.metadata["chunk_index"]
    store = qdrant_with(v1 + v2, "interleaved")
    hits = scored((v2[3], 0.7), (v2[6], 0.6))
    result = RelevantSegmentPostprocessor(vector_store=store, calibration="raw").postprocess_nodes(
        hits
    )
    best = result[0].node
    assert best.metadata["segment_node_ids"] == [v2[i].node_id for i in range(3, 7)]
    start, end = best.metadata["segment_char_range"]
    assert whitespace_equal(best.get_content(), edited(BASE[:3000])[start:end])


def test_links_alone_do_not_join_two_versions(split):
    v1, v2 = versions(BASE[:3000], edited(BASE[:3000]))
    for node in (v1[4], v2[3]):
        del node.metadata["chunk_index"]
    # As stable ids leave them: v2's last chunk links to no successor, and the old version's
    # next chunk links PREVIOUS to it.
    v2[3].relationships.pop(NodeRelationship.NEXT)
    v1[4].relationships[NodeRelationship.PREVIOUS] = RelatedNodeInfo(node_id=v2[3].node_id)
    result = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
        scored((v2[3], 0.9), (v1[4], 0.9))
    )
    assert [len(r.node.metadata["segment_node_ids"]) for r in result] == [1, 1]


# -- item 6: chunk indices that are no positions ---------------------------------------------------


@pytest.mark.parametrize("huge", [10**8, 10**12, 2**63 + 5])
def test_a_huge_chunk_index_costs_no_more_than_a_small_one(doc_nodes, huge):
    from llama_index.core.vector_stores import SimpleVectorStore

    nodes = doc_nodes("doc", 4)
    nodes[3].metadata["chunk_index"] = huge
    requests = []

    class IndexedStore(SimpleVectorStore):
        """Answers chunk-index filters (so every gap could be read)."""

        def get_nodes(self, node_ids=None, filters=None, limit=None):
            requests.append(filters)
            wanted = [i for sub in filters.filters for i in sub.filters[1].value]
            return [nodes[i] for i in wanted if i < 3]

    rse = RelevantSegmentPostprocessor(vector_store=IndexedStore(), calibration="raw")
    extraction = rse.extract(scored((nodes[0], 0.9), (nodes[2], 0.9), (nodes[3], 0.9)))
    assert sorted((s.start, s.end) for s in extraction.segments) == [(0, 3), (huge, huge + 1)]
    assert len(extraction.values) < 40  # positions near the hits only
    (only,) = requests
    assert [sub.filters[1].value for sub in only.filters] == [[1]]


@pytest.mark.parametrize(
    "value", [-1, 2.5, math.inf, -math.inf, math.nan, True, "third", np.array([1, 2])]
)
def test_a_chunk_index_that_is_no_position_is_an_error_naming_it(doc_nodes, value):
    nodes = doc_nodes("doc", 3)
    nodes[1].metadata["chunk_index"] = value
    with pytest.raises(ValueError, match=r"node 'doc-1' has chunk_index=.*non-negative integer"):
        RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
            scored(*((n, 0.9) for n in nodes))
        )


@pytest.mark.parametrize("value", [np.int64(1), 1.0, np.float32(1.0), "1"])
def test_chunk_indices_of_other_number_types_are_read(doc_nodes, value):
    nodes = doc_nodes("doc", 3)
    nodes[1].metadata["chunk_index"] = value
    (segment,) = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
        scored(*((n, 0.9) for n in nodes))
    )
    assert segment.node.metadata["segment_chunk_range"] == [0, 3]


def test_a_read_back_chunk_with_a_bad_index_is_a_hole(doc_nodes):
    from llama_index.core.vector_stores import SimpleVectorStore

    nodes = doc_nodes("doc", 3)
    for node in nodes:
        node.id_ = str(uuid.uuid5(uuid.NAMESPACE_URL, node.node_id))
    bad = nodes[1].model_copy(deep=True)
    bad.metadata["chunk_index"] = math.inf

    class Store(SimpleVectorStore):
        def get_nodes(self, node_ids=None, filters=None, limit=None):
            return [bad]

    rse = RelevantSegmentPostprocessor(vector_store=Store(), calibration="raw")
    extraction = rse.extract(scored((nodes[0], 0.9), (nodes[2], 0.9)))
    assert [(s.start, s.end) for s in extraction.segments] == [(0, 1), (2, 3)]
    assert any("returned no chunk" in h.reason for h in extraction.holes)


# -- item 10: odd metadata values ------------------------------------------------------------------


def test_numpy_arrays_and_nan_in_metadata_are_kept_or_dropped_like_any_value(doc_nodes):
    nodes = doc_nodes("doc", 3)
    for i, node in enumerate(nodes):
        node.metadata.update(
            vector=np.array([1.0, math.nan]),  # shared, NaN included
            own=np.array([i, i]),  # differs per chunk
            weight=math.nan,  # shared NaN
            nested={"a": [math.nan, 1]},
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (segment,) = RelevantSegmentPostprocessor(calibration="raw").postprocess_nodes(
            scored(*((n, 0.9) for n in nodes))
        )
    metadata = segment.node.metadata
    assert np.array_equal(metadata["vector"], [1.0, math.nan], equal_nan=True)
    assert math.isnan(metadata["weight"]) and "own" not in metadata
    assert metadata["nested"]["a"][1] == 1


# -- item 4's sibling: scores and calibrations ----------------------------------------------------


def test_scores_near_the_float_limit_and_bad_calibrations(doc_nodes):
    nodes = doc_nodes("doc", 3)
    hits = scored((nodes[0], 1e308), (nodes[1], 1.7e308), (nodes[2], 0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow warning: huge scores clip to relevance 1
        (segment,) = RelevantSegmentPostprocessor(calibration="cosine").postprocess_nodes(hits)
    assert segment.node.metadata["segment_chunk_range"] == [0, 3]
    short = RelevantSegmentPostprocessor(calibration=lambda s: s[:1])
    with pytest.raises(ValueError, match=r"returned shape \(1,\) for scores of shape \(3,\)"):
        short.postprocess_nodes(scored((nodes[0], 0.5), (nodes[1], 0.4), (nodes[2], 0.3)))
    words = RelevantSegmentPostprocessor(calibration=lambda s: ["high"] * len(s))
    with pytest.raises(ValueError, match="not numbers"):
        words.postprocess_nodes(scored((nodes[0], 0.5)))
    odd = NodeWithScore(node=nodes[0], score=0.5)
    odd.score = "high"  # assigned after construction: pydantic does not check it
    with pytest.raises(ValueError, match="'high' is not a number"):
        RelevantSegmentPostprocessor().postprocess_nodes([odd])


def test_a_store_or_index_of_the_wrong_kind_is_named_at_construction(doc_nodes):
    # These used to be accepted: at query time a warning said the chunks between hits could not
    # be read (vector_store="x", docstore=StorageContext), or nothing at all (index=a retriever),
    # and segments only joined the chunks at hand.
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.embeddings.mock_embed_model import MockEmbedding
    from llama_index.core.storage.docstore import SimpleDocumentStore

    index = VectorStoreIndex(nodes=doc_nodes("d", 2), embed_model=MockEmbedding(embed_dim=4))
    wrong = {
        "vector_store": "qdrant",
        "docstore": StorageContext.from_defaults(),
        "index": index.as_retriever(),
    }
    for name, part in wrong.items():
        kind = f"{type(part).__name__}, not a LlamaIndex {name.replace('_', ' ')}"
        with pytest.raises(
            TypeError, match=f"{name} is a {kind}: pass index=<your VectorStoreIndex>"
        ):
            RelevantSegmentPostprocessor(**{name: part})
    for right in (
        {"index": index},
        {"docstore": SimpleDocumentStore()},
        {"vector_store": index.vector_store},
    ):
        RelevantSegmentPostprocessor(**right)


def test_a_docstore_that_holds_the_documents_not_their_chunks_says_so(caplog):
    # An IngestionPipeline's docstore (its duplicate check) holds the Documents: passed as RSE's
    # docstore it read none of the chunks between the hits, and RSE returned the hits alone
    # without a word.
    from llama_index.core.storage.docstore import SimpleDocumentStore

    document = Document(text=BASE[:3000], id_="doc")
    nodes = ChunkIndexer(stable_ids=True)(
        SentenceSplitter(chunk_size=64, chunk_overlap=0).get_nodes_from_documents([document])
    )
    docstore = SimpleDocumentStore()
    docstore.add_documents([document])
    rse = RelevantSegmentPostprocessor(docstore=docstore, calibration="raw")
    with caplog.at_level(logging.WARNING):
        rse.postprocess_nodes(scored((nodes[1], 0.9), (nodes[4], 0.8)))
    assert "holds its documents, not their chunks: pass vector_store= or index=" in caplog.text


def test_hits_given_sentence_windows_before_rse_are_warned_about():
    from llama_index.core.node_parser import SentenceWindowNodeParser
    from llama_index.core.postprocessor import MetadataReplacementPostProcessor
    from llama_index.core.storage.docstore import SimpleDocumentStore

    text = " ".join(f"Fact {i} is that item {i} weighs {i * 3} grams." for i in range(40))
    parser = SentenceWindowNodeParser.from_defaults(window_size=2)
    nodes = ChunkIndexer()(parser.get_nodes_from_documents([Document(text=text, id_="d")]))
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    hits = [NodeWithScore(node=nodes[i].model_copy(deep=True), score=0.9) for i in (10, 12)]
    rse = RelevantSegmentPostprocessor(docstore=docstore)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rse.postprocess_nodes(hits, query_str="item 10")  # the sentences themselves: silent
    windows = MetadataReplacementPostProcessor(target_metadata_key="window")
    # The windows of sentences 10 and 12 joined to sentence 11 read back between them gave
    # "Fact 8 ... Fact 12.\nFact 11.\nFact 10 ... Fact 14." without a word.
    with pytest.warns(UserWarning, match="2 hit.* more or less text than their offsets.*first"):
        (segment,) = rse.postprocess_nodes(windows.postprocess_nodes(hits), query_str="item 10")
    assert segment.node.get_content().count("Fact 11 ") > 1  # what the warning is about


def test_verbose_on_a_console_that_cannot_encode_a_document_id(monkeypatch):
    # A document id such as 報告/東京.txt (filename_as_id=True) on a cp1252 or ASCII console:
    # printing the trace raised UnicodeEncodeError after all the work, losing the result.
    import io
    import sys

    nodes = versions(BASE[:3000], BASE[:3000])[0]
    for node in nodes:
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="報告/東京.txt")
    console = io.TextIOWrapper(io.BytesIO(), encoding="ascii")
    monkeypatch.setattr(sys, "stdout", console)
    rse = RelevantSegmentPostprocessor(verbose=True)
    assert rse.postprocess_nodes(scored((nodes[1], 0.9), (nodes[2], 0.8)))
    console.flush()
    assert "\\u5831\\u544a" in console.buffer.getvalue().decode("ascii")


def test_hits_a_compressor_cut_before_rse_are_warned_about():
    # A postprocessor before RSE that keeps a few sentences of each hit (SentenceEmbedding-
    # Optimizer, a compressor): RSE joined the cut hits to whole chunks read back between them,
    # a passage that is no span of the document, without a word.
    from llama_index.core.storage.docstore import SimpleDocumentStore

    nodes = versions(BASE[:6000], BASE[:6000])[0]
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    hits = [NodeWithScore(node=nodes[i].model_copy(deep=True), score=0.9) for i in (2, 4)]
    for hit in hits:
        hit.node.set_content(hit.node.get_content()[-60:])  # the sentence the compressor kept
    with pytest.warns(UserWarning, match="2 hit.* more or less text than their offsets"):
        RelevantSegmentPostprocessor(docstore=docstore).postprocess_nodes(hits)


#: Text that repeats: SentenceSplitter(chunk_size=38, chunk_overlap=8) places chunks 1 and 2 at
#: earlier copies of their text (12 and 15; they hold 28 and 55).
REPEATED = "東京は日本の首都です。" + "漢字かな交じり文" * 12 + "。大阪は第二の都市です。"


def repeated_extraction(hit_indices, *, documents: bool, **options):
    from llama_index.core.storage.docstore import SimpleDocumentStore

    document = Document(text=REPEATED, id_="jp")
    splitter = SentenceSplitter(chunk_size=38, chunk_overlap=8)
    indexer = ChunkIndexer(stable_ids=True, documents=[document] if documents else ())
    nodes = indexer(splitter.get_nodes_from_documents([document]))
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    rse = RelevantSegmentPostprocessor(docstore=docstore, **options)
    hits = [NodeWithScore(node=nodes[i], score=0.9 - 0.01 * k) for k, i in enumerate(hit_indices)]
    return rse.postprocess_nodes(hits)


@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("options", [{}, {"max_context_chars": 2000}])
def test_repeated_text_is_never_invented(documents, options):
    # The splitter's offsets put chunk 2 at 15 (it holds 55): the "gap" to chunk 3 was refilled
    # with 33 newlines where the document has text, under segment_char_range [15, 119].
    (segment,) = repeated_extraction([2, 3, 4], documents=documents, **options)
    text = segment.get_content()
    char_range = segment.metadata["segment_char_range"]
    assert text.count("\n") == (0 if documents else segment.metadata["segment_gaps"])
    if documents:  # offsets checked at ingestion: the exact text, with its range
        assert char_range == [55, 119] and REPEATED[55:119] == text
    else:  # joined whole where repeated text leaves the overlap unknown
        assert char_range is None
        assert all(piece in REPEATED for piece in text.split("\n"))


@pytest.mark.parametrize("documents", [False, True])
def test_repeated_text_is_never_lost(documents):
    # Every chunk a hit: the text match cut 23 characters where chunks 0 and 1 share 7, so 8 of
    # the 12 copies came back, without a word.
    (segment,) = repeated_extraction(range(5), documents=documents)
    assert segment.get_content().count("漢字かな交じり文") >= 12
    if documents:
        assert segment.get_content() == REPEATED
        assert segment.metadata["segment_char_range"] == [0, len(REPEATED)]


def moved_chunk_index():
    """A document's text, its chunks, and an index whose docstore lists chunk 5 last (deleted,
    then inserted again).
    """
    from llama_index.core import VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding

    text = " ".join(f"Sentence {i} says something about topic {i}." for i in range(120))
    splitter = SentenceSplitter(chunk_size=64, chunk_overlap=8)
    nodes = splitter.get_nodes_from_documents([Document(text=text, id_="d")])
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    index.delete_nodes([nodes[5].node_id], delete_from_docstore=True)
    index.insert_nodes([nodes[5]])
    assert index.docstore.get_ref_doc_info("d").node_ids[-1] == nodes[5].node_id
    return text, nodes, index


def test_a_docstore_listing_out_of_document_order_is_ordered_by_offsets(caplog):
    """A docstore lists a document's nodes in the order they were added: a chunk deleted and
    inserted again came last, RSE took the listing for the document's order, split the segment
    around that chunk and blamed the links in its hole warning.
    """
    text, nodes, index = moved_chunk_index()
    rse = RelevantSegmentPostprocessor(index=index)
    for picked in ([4, 5, 6], [4, 6]):
        with caplog.at_level(logging.WARNING):
            (segment,) = rse.postprocess_nodes(
                [NodeWithScore(node=nodes[i], score=0.9) for i in picked]
            )
        start, end = segment.metadata["segment_char_range"]
        assert (start, end) == (nodes[4].start_char_idx, nodes[6].end_char_idx)
        assert text[start:end] == segment.get_content()
    assert "hole" not in caplog.text


def test_a_moved_chunk_no_hit_lies_next_to_is_a_hole_naming_the_cause(caplog):
    # Hits 3 and 7 agree with the listing (their neighbours 4 and 6 are listed beside them):
    # the move shows only once the chunks between are read. The hole warning named the links
    # alone, and its fix (an older version's leftovers) was not this one.
    text, nodes, index = moved_chunk_index()
    rse = RelevantSegmentPostprocessor(index=index)
    with caplog.at_level(logging.WARNING):
        result = rse.postprocess_nodes([NodeWithScore(node=nodes[i], score=0.9) for i in (3, 7)])
    assert "deleted and inserted again last" in caplog.text
    assert f"links NEXT to {nodes[5].node_id}" in caplog.text
    for item in result:  # never joined over the moved chunk: each piece is the document's text
        start, end = item.node.metadata["segment_char_range"]
        assert text[start:end] == item.node.get_content()
        assert end <= nodes[5].start_char_idx or start >= nodes[5].end_char_idx
