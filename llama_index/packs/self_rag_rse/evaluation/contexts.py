"""What an engine's response retrieved: the context texts a judge reads, placed in the documents.

Every engine compared here returns its evidence as ``response.source_nodes``: chunks (top-k),
RSE segments, or the paragraphs Self-RAG judged. A node is placed in its document by, in order,
RSE's ``segment_char_range``, the node's ``start_char_idx``/``end_char_idx`` (kept when the text
there matches), or a search for its text; a node that cannot be placed still counts as returned
text (against evidence precision).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore

from llama_index.packs.self_rag_rse.evaluation.evidence import Span, find_span
from llama_index.packs.self_rag_rse.evaluation.questions import resolve_document

#: Node metadata keys that may name the node's document, tried in order (then ``ref_doc_id``).
DOCUMENT_KEYS = ("segment_document_id", "file_path", "file_name")


@dataclass
class Retrieved:
    """The contexts of one response and where they lie in the documents."""

    texts: list[str] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    unplaced_chars: int = 0


def retrieved_contexts(
    source_nodes: Sequence[NodeWithScore], documents: Mapping[str, str] | None = None
) -> Retrieved:
    """The texts of ``source_nodes`` (in order) and, with ``documents``, their spans."""
    out = Retrieved()
    for item in source_nodes:
        text = item.node.get_content(metadata_mode=MetadataMode.NONE)
        if not text.strip():
            continue
        out.texts.append(text)
        if documents is None:
            continue
        span = place_node(item.node, text, documents)
        if span is None:
            out.unplaced_chars += len(text)
        else:
            out.spans.append(span)
    return out


def place_node(node: Any, text: str, documents: Mapping[str, str]) -> Span | None:
    """``(document, start, end)`` of ``node`` in ``documents``, or ``None``."""
    name = node_document(node, documents)
    if name is None:
        return None
    doc = documents[name]
    meta = node.metadata or {}
    hints = []
    if isinstance(meta.get("segment_char_range"), (list, tuple)):
        hints.append(tuple(meta["segment_char_range"]))
    start, end = getattr(node, "start_char_idx", None), getattr(node, "end_char_idx", None)
    if start is not None and end is not None:
        hints.append((start, end))
    for hint in hints:
        a, b = int(hint[0]), int(hint[1])
        # Offsets are trusted when the text there is the node's, whitespace aside (RSE puts
        # back whitespace a splitter stripped, not necessarily the same characters).
        if 0 <= a < b <= len(doc) and doc[a:b].split() == text.split():
            return name, a, b
    found = find_span(doc, text, near=int(hints[0][0]) if hints else None)
    if found is not None:
        return name, found[0], found[1]
    if hints:
        a, b = int(hints[0][0]), int(hints[0][1])
        if 0 <= a < b <= len(doc):
            return name, a, b
    return None


def node_document(node: Any, documents: Mapping[str, str]) -> str | None:
    """The key of ``documents`` that ``node`` comes from, by its metadata or ``ref_doc_id``."""
    meta = node.metadata or {}
    candidates = [meta.get(key) for key in DOCUMENT_KEYS]
    candidates.append(getattr(node, "ref_doc_id", None))
    for candidate in candidates:
        if not candidate:
            continue
        name = resolve_document(str(candidate), documents)
        if name is not None:
            return name
        # An absolute file path (SimpleDirectoryReader's file_path, or doc id with
        # filename_as_id) ends with the document's relative path.
        as_path = Path(str(candidate)).as_posix()
        for key in documents:
            if as_path.endswith("/" + key):
                return key
    return None
