"""ChunkIndexer: each chunk's position in its document, stamped at ingestion."""

from __future__ import annotations

import itertools
import pickle
import random

import pytest
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import (
    Document,
    MetadataMode,
    NodeRelationship,
    RelatedNodeInfo,
    TextNode,
)

from llama_index.packs.self_rag_rse import CHUNK_INDEX_KEY, ChunkIndexer


def test_numbers_each_document_in_order(corpus_nodes):
    by_doc: dict[str, list] = {}
    for node in corpus_nodes:
        by_doc.setdefault(node.ref_doc_id, []).append(node)
    assert len(by_doc) == 2
    for nodes in by_doc.values():
        ordered = sorted(nodes, key=lambda n: n.metadata[CHUNK_INDEX_KEY])
        assert [n.metadata[CHUNK_INDEX_KEY] for n in ordered] == list(range(len(nodes)))
        starts = [n.start_char_idx for n in ordered]
        assert starts == sorted(starts)
        assert CHUNK_INDEX_KEY in nodes[0].excluded_embed_metadata_keys
        assert CHUNK_INDEX_KEY in nodes[0].excluded_llm_metadata_keys


def test_offsets_win_over_arrival_order_in_a_pipeline(split):
    nodes = split(64, 0)
    shuffled = random.Random(1).sample([n.model_copy(deep=True) for n in nodes], len(nodes))
    stamped = IngestionPipeline(transformations=[ChunkIndexer(key="position")]).run(nodes=shuffled)
    by_id = {n.node_id: n.metadata["position"] for n in stamped}
    assert [by_id[n.node_id] for n in nodes] == list(range(len(nodes)))
    # Embeddings and prompts do not change: the key is hidden from both.
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        assert "position" not in stamped[0].get_content(metadata_mode=mode)


def test_arrival_order_without_offsets_and_orphans_left_alone():
    source = {NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc")}
    loose = [TextNode(id_=f"c{i}", text=f"chunk {i}", relationships=dict(source)) for i in range(3)]
    orphan = TextNode(text="no document")
    ChunkIndexer()([loose[2], orphan, loose[0], loose[1]])
    assert [n.metadata[CHUNK_INDEX_KEY] for n in loose] == [1, 2, 0]
    assert CHUNK_INDEX_KEY not in orphan.metadata


def test_stable_ids_rename_the_chunks_and_their_links(split):
    from llama_index.packs.self_rag_rse.rse.chunk_index import stable_chunk_id

    nodes = split(64, 0)
    kept = ChunkIndexer()([n.model_copy(deep=True) for n in nodes])
    assert [n.node_id for n in kept] == [n.node_id for n in nodes]  # off by default
    renamed = ChunkIndexer(stable_ids=True)([n.model_copy(deep=True) for n in nodes])
    doc_id = nodes[0].ref_doc_id
    assert [n.node_id for n in renamed] == [stable_chunk_id(doc_id, i) for i in range(len(nodes))]
    for before, after in itertools.pairwise(renamed):
        assert after.relationships[NodeRelationship.PREVIOUS].node_id == before.node_id
        assert before.relationships[NodeRelationship.NEXT].node_id == after.node_id
    assert all(n.ref_doc_id == doc_id for n in renamed)  # SOURCE still names the document
    # The same document always gets the same ids: re-ingesting it overwrites its chunks.
    again = ChunkIndexer(stable_ids=True)([n.model_copy(deep=True) for n in split(64, 0)])
    assert [n.node_id for n in again] == [n.node_id for n in renamed]
    assert stable_chunk_id("doc", 1) != stable_chunk_id("doc", 2) != stable_chunk_id("doc2", 2)


def test_whole_documents_before_the_splitter_are_refused_naming_the_fix():
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    # A Document is no chunk: nothing would be numbered, and RSE would find no positions.
    pipeline = IngestionPipeline(
        transformations=[ChunkIndexer(), SentenceSplitter(chunk_size=64, chunk_overlap=0)]
    )
    document = Document(text="Herons nest in colonies. " * 40, id_="doc")
    with pytest.raises(ValueError, match="Put ChunkIndexer right after the splitter") as error:
        pipeline.run(documents=[document])
    assert "'doc'" in str(error.value)


# -- a call holding part of a document ------------------------------------------------------------


def _batches(nodes, size=10):
    return [nodes[i : i + size] for i in range(0, len(nodes), size)]


def _stored(nodes):
    """Embedded copies of ``nodes`` written to a fresh Qdrant collection; its point count."""
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    store = QdrantVectorStore(client=QdrantClient(location=":memory:"), collection_name="batches")
    for node in nodes:
        node.embedding = [1.0, 0.0]
    store.add(nodes)
    return store.client.count("batches").count


def test_batches_of_a_split_document_are_an_error_naming_the_fix(split):
    # Issue 18, item 1: pre-split nodes ingested 10 at a time were numbered 0..9 in every batch,
    # so stable ids repeated and 75 chunks became 10 stored points without a word.
    nodes = [n.model_copy(deep=True) for n in split(64, 0, "typesseq")]
    assert len(nodes) > 30
    pipeline = IngestionPipeline(transformations=[ChunkIndexer(stable_ids=True)])
    with pytest.raises(ValueError, match="only part of document 'typesseq'") as error:
        for batch in _batches(nodes):
            pipeline.run(nodes=batch)
    assert "links PREVIOUS" in str(error.value)
    assert "stamp indices when splitting whole documents" in str(error.value)


def test_batches_keep_indices_stamped_on_the_whole_document(split):
    nodes = ChunkIndexer(stable_ids=True)(
        [n.model_copy(deep=True) for n in split(64, 0, "typesseq")]
    )
    expected = [(n.node_id, n.metadata[CHUNK_INDEX_KEY]) for n in nodes]
    pipeline = IngestionPipeline(transformations=[ChunkIndexer(stable_ids=True)])
    stored = [node for batch in _batches(nodes) for node in pipeline.run(nodes=batch)]
    assert [(n.node_id, n.metadata[CHUNK_INDEX_KEY]) for n in stored] == expected
    assert _stored(stored) == len(nodes)
    for before, after in itertools.pairwise(stored):  # links still name the stable ids
        assert before.relationships[NodeRelationship.NEXT].node_id == after.node_id
        assert after.relationships[NodeRelationship.PREVIOUS].node_id == before.node_id


def test_offsets_alone_show_a_later_part_of_a_document(split):
    nodes = [n.model_copy(deep=True) for n in split(64, 0)]
    for node in nodes:
        node.relationships.pop(NodeRelationship.NEXT, None)
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
    with pytest.raises(ValueError, match=r"start at character \d+"):
        ChunkIndexer()(nodes[5:9])
    # The first part is numbered from 0: its offsets start the document.
    assert [n.metadata[CHUNK_INDEX_KEY] for n in ChunkIndexer()(nodes[:4])] == [0, 1, 2, 3]


def test_leading_whitespace_is_not_a_missing_start():
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    text = "\n\n\n\n\n\n   " + "A sentence about herons and their nests. " * 30
    splitter = SentenceSplitter(chunk_size=32, chunk_overlap=0)
    linked = splitter.get_nodes_from_documents([Document(text=text, id_="d")])
    assert linked[0].start_char_idx > 4  # the splitter stripped the leading whitespace
    stamped = ChunkIndexer()(linked)  # the first chunk links to no predecessor: it is first
    assert [n.metadata[CHUNK_INDEX_KEY] for n in stamped] == list(range(len(linked)))
    short = Document(text="\t    alpha ", id_="s")
    (only,) = ChunkIndexer()(splitter.get_nodes_from_documents([short]))  # unlinked, start 5
    assert only.start_char_idx == 5 and only.metadata[CHUNK_INDEX_KEY] == 0
    unlinked = SentenceSplitter(chunk_size=32, chunk_overlap=0, include_prev_next_rel=False)
    nodes = unlinked.get_nodes_from_documents([Document(text=text, id_="u")])
    stamped = ChunkIndexer()(nodes)  # 9 characters in: less than half a chunk
    assert [n.metadata[CHUNK_INDEX_KEY] for n in stamped] == list(range(len(nodes)))


def test_one_missing_chunk_between_linked_members_keeps_true_indices(split):
    from llama_index.packs.self_rag_rse.rse.chunk_index import stable_chunk_id

    nodes = [n.model_copy(deep=True) for n in split(64, 0)][:8]
    kept = nodes[:3] + nodes[4:]  # chunk 3 dropped after splitting (a filter, say)
    stamped = ChunkIndexer(stable_ids=True)(kept)
    assert [n.metadata[CHUNK_INDEX_KEY] for n in stamped] == [0, 1, 2, 4, 5, 6, 7]
    gap = stable_chunk_id(nodes[0].ref_doc_id, 3)  # both neighbours name chunk 3's stable id
    assert stamped[2].relationships[NodeRelationship.NEXT].node_id == gap
    assert stamped[3].relationships[NodeRelationship.PREVIOUS].node_id == gap
    fresh = split(64, 0)[:8]
    two_gone = [n.model_copy(deep=True) for n in fresh[:3] + fresh[5:]]
    with pytest.raises(ValueError, match="chunks between"):
        ChunkIndexer()(two_gone)
    # Nodes stamped before (on the whole document) keep their indices.
    assert [n.metadata[CHUNK_INDEX_KEY] for n in ChunkIndexer()(stamped[:2] + stamped[4:])] == [
        0,
        1,
        5,
        6,
        7,
    ]


def test_each_chunk_gets_its_documents_version(split):
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_VERSION_KEY

    splitter = SentenceSplitter(chunk_size=64, chunk_overlap=0)
    v1 = Document(text="Herons nest in colonies. " * 40, id_="doc")
    v2 = Document(text="Herons nest in colonies. " * 20 + "They eat fish.", id_="doc")
    first = ChunkIndexer()(splitter.get_nodes_from_documents([v1]))
    second = ChunkIndexer()(splitter.get_nodes_from_documents([v2]))
    assert {n.metadata[CHUNK_VERSION_KEY] for n in first} == {v1.hash}
    assert {n.metadata[CHUNK_VERSION_KEY] for n in second} == {v2.hash} != {v1.hash}
    for mode in (MetadataMode.LLM, MetadataMode.EMBED):
        assert v1.hash not in first[0].get_content(metadata_mode=mode)
    # Without a document hash on SOURCE, a hash of the document's chunk texts stands in.
    source = {NodeRelationship.SOURCE: RelatedNodeInfo(node_id="doc")}
    bare = [TextNode(text=f"chunk {i}", relationships=dict(source)) for i in range(3)]
    again = [n.model_copy(deep=True) for n in bare]
    ChunkIndexer()(bare)
    ChunkIndexer()(again)
    assert len({n.metadata[CHUNK_VERSION_KEY] for n in bare + again}) == 1


def test_a_node_given_twice_is_one_chunk(split):
    nodes = [n.model_copy(deep=True) for n in split(64, 0)][:4]
    twice = nodes[2].model_copy(deep=True)  # the same chunk again (same id)
    stamped = ChunkIndexer(stable_ids=True)([*nodes, twice])
    assert [n.metadata[CHUNK_INDEX_KEY] for n in stamped] == [0, 1, 2, 3, 2]
    assert stamped[4].node_id == stamped[2].node_id  # one id: one point in the store


def test_batches_keep_the_version_stamped_on_the_whole_document(split):
    from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_VERSION_KEY

    nodes = [n.model_copy(deep=True) for n in split(64, 0)]
    for node in nodes:  # no document hash: the version is a hash of the document's chunks
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="execmodel")
    ChunkIndexer()(nodes)
    (version,) = {n.metadata[CHUNK_VERSION_KEY] for n in nodes}
    batches = [ChunkIndexer()(batch) for batch in _batches(nodes, 4)]
    assert {n.metadata[CHUNK_VERSION_KEY] for batch in batches for n in batch} == {version}


def test_two_documents_sharing_an_id_are_refused_naming_it():
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    # Numbered as one document, RSE would join the two documents' chunks into one segment.
    documents = [
        Document(text="Alpha one. Alpha two.", id_="same"),
        Document(text="Beta one. Beta two.", id_="same"),
    ]
    chunks = SentenceSplitter(chunk_size=8, chunk_overlap=0)(documents)
    with pytest.raises(ValueError, match=r"'same'.*filename_as_id"):
        ChunkIndexer()(chunks)


def test_hierarchical_parents_are_refused_naming_the_leaves() -> None:
    from llama_index.core.node_parser import HierarchicalNodeParser, get_leaf_nodes

    text = " ".join(f"Sentence {i} says something of its own." for i in range(300))
    nodes = HierarchicalNodeParser.from_defaults(chunk_sizes=[512, 128])([Document(text=text)])
    # Parents and leaves numbered together put a 2,000-character parent at index 0 beside its
    # own first leaf at 1: RSE joined them.
    with pytest.raises(ValueError, match=r"with children .*get_leaf_nodes\(nodes\)"):
        ChunkIndexer()(nodes)
    leaves = sorted(ChunkIndexer()(get_leaf_nodes(nodes)), key=lambda n: n.start_char_idx)
    assert [n.metadata[CHUNK_INDEX_KEY] for n in leaves] == list(range(len(leaves)))


#: Text that repeats: SentenceSplitter(chunk_size=38, chunk_overlap=8) places chunks 1 and 2 at
#: earlier copies of their text (12 and 15); they hold 28 and 55.
REPEATED = "東京は日本の首都です。" + "漢字かな交じり文" * 12 + "。大阪は第二の都市です。"


def repeated_pipeline(**options):
    from llama_index.core.node_parser import SentenceSplitter

    splitter = SentenceSplitter(chunk_size=38, chunk_overlap=8)
    return IngestionPipeline(transformations=[splitter, ChunkIndexer(**options)])


def test_given_the_documents_each_chunk_gets_its_own_copy_of_repeated_text():
    from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY

    document = Document(text=REPEATED, id_="jp")
    as_split = repeated_pipeline(stable_ids=True).run(documents=[document])
    assert [n.start_char_idx for n in as_split] == [0, 12, 15, 82, 100]  # the splitter's
    assert not any(OFFSETS_CHECKED_KEY in n.metadata for n in as_split)
    placed = repeated_pipeline(stable_ids=True, documents=[document]).run(documents=[document])
    assert [n.start_char_idx for n in placed] == [0, 28, 55, 82, 100]
    for node in placed:
        assert REPEATED[node.start_char_idx : node.end_char_idx] == node.text
        assert node.metadata[OFFSETS_CHECKED_KEY] is True
        for mode in (MetadataMode.LLM, MetadataMode.EMBED):
            assert node.get_content(metadata_mode=mode) == node.text  # hidden from both
    # IngestionPipeline(num_workers=2) pickles its transformations: the documents go along.
    unpickled = pickle.loads(pickle.dumps(ChunkIndexer(documents=[document])))
    splitter = repeated_pipeline().transformations[0]
    nodes = unpickled(splitter.get_nodes_from_documents([document]))
    assert [n.start_char_idx for n in nodes] == [0, 28, 55, 82, 100]


def test_documents_that_are_not_the_chunks_source_change_nothing():
    from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY

    document = Document(text=REPEATED, id_="jp")
    other = Document(text=REPEATED.replace("大阪", "京都"), id_="jp")  # another version
    nodes = repeated_pipeline(documents=[other]).run(documents=[document])
    assert [n.start_char_idx for n in nodes] == [0, 12, 15, 82, 100]
    assert not any(OFFSETS_CHECKED_KEY in n.metadata for n in nodes)


def test_a_call_holding_part_of_a_document_keeps_the_splitters_offsets():
    # Nodes ingested in batches after splitting: a batch cannot be placed in the document (the
    # chunks before it are elsewhere), so its offsets stay as the splitter left them, unmarked.
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY

    document = Document(text=REPEATED, id_="jp")
    splitter = SentenceSplitter(chunk_size=38, chunk_overlap=8)
    nodes = ChunkIndexer()(splitter.get_nodes_from_documents([document]))
    batch = ChunkIndexer(documents=[document])(nodes[1:3])
    assert [n.start_char_idx for n in batch] == [12, 15]  # the splitter's, misplaced
    assert [n.metadata[CHUNK_INDEX_KEY] for n in batch] == [1, 2]  # stamped before: kept
    assert not any(OFFSETS_CHECKED_KEY in n.metadata for n in batch)


def test_a_misspelt_option_is_an_error_naming_the_closest():
    # Pydantic dropped it: ChunkIndexer(stabel_ids=True) ran with stable_ids=False.
    with pytest.raises(TypeError, match="'stabel_ids' \\(did you mean 'stable_ids'\\?\\)"):
        ChunkIndexer(stabel_ids=True)
