"""Stamp each chunk's position in its document at ingestion time.

LlamaIndex nodes carry no chunk index: order comes from PREVIOUS/NEXT relationships or
``start_char_idx``, which say nothing about how many chunks lie between two hits. With an index
stamped into the metadata, :class:`~llama_index.packs.self_rag_rse.RelevantSegmentPostprocessor`
knows every hit's position without reading whole documents back, and fetches exactly the chunks
between hits with one filtered call to the vector store.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field
from llama_index.core.schema import BaseNode, TransformComponent

#: Metadata key holding a chunk's 0-based position within its source document.
CHUNK_INDEX_KEY = "chunk_index"


class ChunkIndexer(TransformComponent):
    """Write each node's 0-based position within its document into ``metadata[key]``.

    Put it in an ``IngestionPipeline`` right after the splitter. Nodes are numbered per source
    document (``ref_doc_id``) in ``start_char_idx`` order, or in the order they arrive in (the
    splitter's) when any node lacks an offset. The key is excluded from the text that is
    embedded and shown to the LLM, so adding it changes neither embeddings nor prompts. Nodes
    without a source document are left alone.
    """

    key: str = Field(default=CHUNK_INDEX_KEY, description="Metadata key to write.")

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
        for members in by_document.values():
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
        return nodes
