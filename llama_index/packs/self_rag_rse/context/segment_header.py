"""Give an RSE segment node its document/section header, once, ahead of the segment text.

Chunk headers are embedded, never shown to the answer LLM (it would read the same header once
per chunk). A segment is what the LLM reads, so it gets one header naming its document and the
section(s) it spans. The node's text stays the exact text of its span (offsets and char ranges
keep their meaning); the header is metadata that core's machinery puts first in the LLM text::

    segment.get_content(MetadataMode.LLM)  ->  "Document: ...\\nSection: ...\\n\\n<segment text>"
    segment.get_content(MetadataMode.NONE) ->  "<segment text>"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.schema import BaseNode

from llama_index.packs.self_rag_rse.context.compose import compose_segment_header
from llama_index.packs.self_rag_rse.context.keys import (
    DOCUMENT_SUMMARY_KEY,
    DOCUMENT_TITLE_KEY,
    SEGMENT_HEADER_KEY,
    section_path,
)


def segment_header(node: BaseNode, members: Sequence[BaseNode] = ()) -> str:
    """The header for a segment ``node`` made of ``members`` (its chunks, in order).

    The document title and summary are read from the members (or the node's own metadata,
    which holds what all members share); the sections are every distinct section path among
    the members, in order. Empty when the chunks carry no title and no section (they were not
    ingested with :class:`ContextualHeaders`).
    """
    sources = list(members) or [node]
    first = sources[0].metadata
    title = _text(first, DOCUMENT_TITLE_KEY) or _text(node.metadata, DOCUMENT_TITLE_KEY)
    summary = _text(first, DOCUMENT_SUMMARY_KEY) or _text(node.metadata, DOCUMENT_SUMMARY_KEY)
    paths = [section_path(m.metadata) for m in sources]
    return compose_segment_header(title, summary, [p for p in paths if p])


def _text(metadata: dict[str, Any], key: str) -> str | None:
    """A non-empty text value, else ``None`` (other types, numpy arrays included, are not
    header text, and are never tested for truth).
    """
    value = metadata.get(key)
    return value if isinstance(value, str) and value.strip() else None


def add_segment_header(node: BaseNode, members: Sequence[BaseNode] = ()) -> BaseNode:
    """Write :func:`segment_header` into ``node``'s metadata so its LLM text starts with it.

    The header becomes the only metadata the LLM and the embedding see (``metadata_template``
    ``"{value}"``); other keys stay on the node for code to read. A node whose members carry no
    header information is returned unchanged. Returns ``node`` (changed in place).
    """
    header = segment_header(node, members)
    if not header:
        return node
    rest = {k: v for k, v in node.metadata.items() if k != SEGMENT_HEADER_KEY}
    node.metadata = {SEGMENT_HEADER_KEY: header, **rest}
    node.metadata_template = "{value}"
    node.excluded_llm_metadata_keys = list(rest)
    node.excluded_embed_metadata_keys = list(rest)
    return node
