"""ChunkIndexer: each chunk's position in its document, stamped at ingestion."""

from __future__ import annotations

import itertools
import random

from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.schema import MetadataMode, NodeRelationship, RelatedNodeInfo, TextNode

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
