"""Stamp each chunk's position in its document at ingestion time.

LlamaIndex nodes carry no chunk index: order comes from PREVIOUS/NEXT relationships or
``start_char_idx``, which say nothing about how many chunks lie between two hits. With an index
stamped into the metadata, :class:`~llama_index.packs.self_rag_rse.RelevantSegmentPostprocessor`
knows every hit's position without reading whole documents back, and fetches exactly the chunks
between hits with one call to the vector store.

That call is a metadata filter, unless the chunks also carry *stable ids*
(``ChunkIndexer(stable_ids=True)``): each node id is then derived from its document id and chunk
index (:func:`stable_chunk_id`), so the postprocessor can name the chunks between two hits and
read them by id. Qdrant local mode answers a filter by scanning every point in Python (about
150 ms at 10,000 chunks), and a read by id directly.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, RelatedNodeInfo, TransformComponent

#: Metadata key holding a chunk's 0-based position within its source document.
CHUNK_INDEX_KEY = "chunk_index"

#: Namespace of :func:`stable_chunk_id` (a fixed, random UUID: ids never change between releases).
STABLE_ID_NAMESPACE = uuid.UUID("c0e4e7a6-5d84-4340-98bf-02103002f0f7")


def stable_chunk_id(doc_id: str, index: int) -> str:
    """The node id :class:`ChunkIndexer` gives chunk ``index`` of document ``doc_id`` with
    ``stable_ids=True``: a UUID (version 5) of the two, valid in every vector store."""
    return str(uuid.uuid5(STABLE_ID_NAMESPACE, f"{doc_id}\n{int(index)}"))


class ChunkIndexer(TransformComponent):
    """Write each node's 0-based position within its document into ``metadata[key]``.

    Put it in an ``IngestionPipeline`` right after the splitter. Nodes are numbered per source
    document (``ref_doc_id``) in ``start_char_idx`` order, or in the order they arrive in (the
    splitter's) when any node lacks an offset. The key is excluded from the text that is
    embedded and shown to the LLM, so adding it changes neither embeddings nor prompts. Nodes
    without a source document are left alone.

    With ``stable_ids=True`` every numbered node is also renamed to
    :func:`stable_chunk_id` of its document and index, and the relationships (NEXT, PREVIOUS,
    PARENT, CHILD) of the nodes in the same call are rewritten to the new ids. The postprocessor
    then reads the chunks between hits by id (see the module docstring), and re-ingesting a
    document overwrites its chunks instead of adding copies. Leave it off if something outside
    the pipeline keeps the splitter's node ids (an ``id_func``, references stored elsewhere).

    Example::

        pipeline = IngestionPipeline(
            transformations=[SentenceSplitter(), ChunkIndexer(stable_ids=True), embed_model],
            vector_store=vector_store,
        )
    """

    key: str = Field(default=CHUNK_INDEX_KEY, description="Metadata key to write.")
    stable_ids: bool = Field(
        default=False,
        description=(
            "Rename each numbered node to a UUID of its document id and chunk index (and "
            "rewrite the relationships among the nodes of the call), so RSE reads the chunks "
            "between hits by id."
        ),
    )

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "ChunkIndexer"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Stamp the chunk index on every node that has a source document."""
        by_document: dict[str, list[tuple[int, BaseNode]]] = defaultdict(list)
        for arrival, node in enumerate(nodes):
            if node.ref_doc_id is not None:
                by_document[node.ref_doc_id].append((arrival, node))
        renamed: dict[str, str] = {}
        for doc_id, members in by_document.items():
            starts = [getattr(node, "start_char_idx", None) for _, node in members]
            if all(start is not None for start in starts):
                order = sorted(range(len(members)), key=lambda i: (starts[i], members[i][0]))
                members[:] = [members[i] for i in order]
            for index, (_, node) in enumerate(members):
                node.metadata[self.key] = index
                for excluded in (
                    node.excluded_embed_metadata_keys,
                    node.excluded_llm_metadata_keys,
                ):
                    if self.key not in excluded:
                        excluded.append(self.key)
                if self.stable_ids:
                    renamed[node.node_id] = stable_chunk_id(doc_id, index)
        if renamed:
            _rename(nodes, renamed)
        return nodes


def _rename(nodes: Sequence[BaseNode], renamed: dict[str, str]) -> None:
    """Give nodes their new ids and point every relationship among them at the new ids."""

    def moved(info: RelatedNodeInfo) -> RelatedNodeInfo:
        new = renamed.get(info.node_id)
        return info if new is None else info.model_copy(update={"node_id": new})

    for node in nodes:
        if node.node_id in renamed:
            node.node_id = renamed[node.node_id]
        for relation, related in list(node.relationships.items()):
            if isinstance(related, list):
                node.relationships[relation] = [moved(info) for info in related]
            else:
                node.relationships[relation] = moved(related)
