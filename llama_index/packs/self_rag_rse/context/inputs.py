"""Where each ingestion component goes in a pipeline, checked on what it is given.

:class:`~.sectioner.DocumentSectioner` takes the splitter's place (documents in, chunks out) and
:class:`~.headers.ContextualHeaders` comes after it (chunks in). Put in the wrong place, each
would run without complaint and quietly spoil the index: the sectioner after a splitter
sections every chunk as if it were a document, so the chunks' offsets point into the chunk
while their source still names the document (RSE then finds the texts contradicting the
offsets and breaks segments there), and the headers before the splitter name no section and
are copied into every chunk.

The two are told apart the way LlamaIndex marks them: a splitter gives every chunk a SOURCE
relationship naming the document it was cut from (``node.ref_doc_id``), while a reader's
``Document`` has none.
"""

from __future__ import annotations

from collections.abc import Sequence

from llama_index.core.schema import BaseNode, Document

#: The pipeline both messages show.
PIPELINE = (
    "IngestionPipeline(transformations=[DocumentSectioner(splitter=SentenceSplitter(...)), "
    "ChunkIndexer(), ContextualHeaders(), embed_model])"
)


def source_of(node: BaseNode) -> str | None:
    """The id of the document ``node`` was cut from, or ``None`` when it is a document itself."""
    source = node.ref_doc_id
    return source if source is not None and source != node.node_id else None


def check_documents(component: str, nodes: Sequence[BaseNode]) -> None:
    """Raise ``ValueError`` if any of ``nodes`` is already a chunk of a document."""
    chunks = [node for node in nodes if source_of(node) is not None]
    if chunks:
        first = chunks[0]
        raise ValueError(
            f"{component} got {len(chunks)} node(s) that are already chunks of a document "
            f"(node {first.node_id!r} is a chunk of {source_of(first)!r}): a chunk sectioned "
            "as if it were a document gets offsets inside the chunk, which contradict its "
            f"document. {component} replaces the splitter: give it the documents, in the "
            f"splitter's place: {PIPELINE}"
        )


def check_chunks(component: str, nodes: Sequence[BaseNode]) -> None:
    """Raise ``ValueError`` if any of ``nodes`` is a whole ``Document`` (the splitter or the
    sectioner has not run yet)."""
    documents = [node for node in nodes if isinstance(node, Document) and source_of(node) is None]
    if documents:
        raise ValueError(
            f"{component} got {len(documents)} whole document(s) (e.g. {documents[0].node_id!r}, "
            "a Document with no source document): it writes each chunk's header from its "
            "document and section, and a document has no section yet; a splitter after it "
            f"would copy that header into every chunk. Put {component} after the splitter or "
            f"DocumentSectioner (and ChunkIndexer), right before the embedding model: {PIPELINE}"
        )
