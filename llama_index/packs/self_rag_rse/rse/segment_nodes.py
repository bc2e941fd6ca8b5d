"""Turn an extracted segment into LlamaIndex nodes holding the exact text of its span.

The member chunks are stitched (:mod:`~llama_index.packs.self_rag_rse.rse.stitching`); where the
stitch finds a hole the postprocessor could not see before (offsets and texts that disagree),
the segment becomes one node per side of the hole, each with its own true ranges, instead of
one node with text nobody has. Chunks ingested with contextual headers give each node one
header naming its document and section(s), shown to the answer LLM before the segment text
(:func:`~llama_index.packs.self_rag_rse.context.segment_header.add_segment_header`).
"""

from __future__ import annotations

import itertools
import unicodedata
import uuid
from collections.abc import Sequence
from typing import Any

from llama_index.core.schema import BaseNode, NodeRelationship, TextNode

from llama_index.packs.self_rag_rse.context.segment_header import add_segment_header
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY
from llama_index.packs.self_rag_rse.rse.node_fields import char_span, offsets_checked, same_value
from llama_index.packs.self_rag_rse.rse.ordering import linked
from llama_index.packs.self_rag_rse.rse.stitching import stitch_with_breaks
from llama_index.packs.self_rag_rse.rse.types import Segment

#: Metadata keys written on segment nodes (hidden from embedding and LLM text):
#:
#: - ``segment_document_id``: the source document;
#: - ``segment_chunk_range``: chunk indices ``[first, last + 1]``, or ``None`` when unknown;
#: - ``segment_char_range``: ``[start, end]`` in the document, or ``None`` when the offsets were
#:   missing or contradicted by the texts;
#: - ``segment_node_ids``: the member chunks, in order;
#: - ``segment_value``: the segment's value (also the node's score);
#: - ``segment_gaps``: boundaries whose stripped whitespace was refilled (no chunk held it);
#: - ``segment_breaks``: why the segment was cut into several nodes (empty when it was not);
#: - ``segment_partial``: only on the piece a context budget cut to fill what it had left.
SEGMENT_METADATA_KEYS = (
    "segment_document_id",
    "segment_chunk_range",
    "segment_char_range",
    "segment_node_ids",
    "segment_value",
    "segment_gaps",
    "segment_breaks",
    "segment_partial",
)


def segment_nodes(segment: Segment, headers: bool = True) -> list[TextNode]:
    """The node(s) for ``segment``: one, or one per side of each hole the stitch found.

    Metadata shared by every member is kept, minus the chunk index (a segment is not one chunk);
    values compare with :func:`~.node_fields.same_value`, so a shared numpy array or NaN is kept
    like any other value. The :data:`SEGMENT_METADATA_KEYS` are added and hidden from embedding and
    LLM text. When the members carry contextual headers and ``headers`` is true, each node also gets
    ``segment_header``, the only metadata its LLM text shows (once, before the span's text).
    """
    members = segment.members
    texts = [m.get_content() for m in members]
    spans = [char_span(m) for m in members]
    links = [False] + [linked(a, b) for a, b in itertools.pairwise(members)]
    distrust = [m.node_id in segment.distrusted for m in members]
    checked = [offsets_checked(m) for m in members]
    pieces, found = stitch_with_breaks(texts, spans, links, distrust, checked)
    breaks = [b.reason for b in found]
    shared = dict(members[0].metadata)
    for member in members[1:]:
        shared = {k: v for k, v in shared.items() if same_value(member.metadata.get(k), v)}
    shared.pop(CHUNK_INDEX_KEY, None)
    # In order, once each: the segment's keys, then those its first chunk hides, and the index.
    hidden = list(
        dict.fromkeys(
            [*SEGMENT_METADATA_KEYS, *members[0].excluded_llm_metadata_keys, CHUNK_INDEX_KEY]
        )
    )
    source = members[0].relationships.get(NodeRelationship.SOURCE)
    relationships = {NodeRelationship.SOURCE: source} if source is not None else {}

    nodes = []
    for piece in pieces:
        base = segment.chunk_range[0] if segment.chunk_range is not None else None
        chunk_range = None if base is None else [base + piece.first, base + piece.stop]
        known = piece.start_char is not None and piece.end_char is not None
        metadata: dict[str, Any] = {
            **shared,
            "segment_document_id": segment.doc_id,
            "segment_chunk_range": chunk_range,
            "segment_char_range": [piece.start_char, piece.end_char] if known else None,
            "segment_node_ids": [m.node_id for m in members[piece.first : piece.stop]],
            "segment_value": segment.value,
            "segment_gaps": piece.gaps,
            "segment_breaks": breaks,
        }
        node = TextNode(
            id_=_node_id(segment.doc_id, metadata["segment_node_ids"], piece.text),
            text=piece.text,
            metadata=metadata,
            excluded_llm_metadata_keys=hidden,
            excluded_embed_metadata_keys=list(hidden),
            relationships=dict(relationships),
            start_char_idx=piece.start_char if known else None,
            end_char_idx=piece.end_char if known else None,
        )
        if headers:
            add_segment_header(node, members[piece.first : piece.stop])
        nodes.append(node)
    return nodes


def cut_node(node: BaseNode, start: int, keep: int) -> BaseNode | None:
    """``node``'s text from ``start``, at most ``keep`` characters, cut at a word boundary (none in
    its second half: before a character, not a mark) unless it runs to the end; None: empty.
    """
    whole = node.get_content()
    window = whole[start : start + keep + 1]
    if start + keep < len(whole):
        edge = max(window.rfind(" "), window.rfind("\n"))
        end = edge if edge > keep // 2 else keep  # no space in the second half: between characters
        while end > edge and unicodedata.combining(window[end]):
            end -= 1
        window = window[:end]
    if not (text := window.strip()):
        return None
    cut = node.model_copy(deep=True)
    cut.set_content(text)
    meta = cut.metadata
    cut.id_ = _node_id(meta["segment_document_id"], meta["segment_node_ids"], text)
    meta["segment_partial"] = True
    for hidden in (cut.excluded_llm_metadata_keys, cut.excluded_embed_metadata_keys):
        if "segment_partial" not in hidden:  # a header node lists only the keys it had
            hidden.append("segment_partial")
    if meta.get("segment_char_range") is not None:
        first = meta["segment_char_range"][0] + start + len(window) - len(window.lstrip())
        meta["segment_char_range"] = [first, first + len(text)]
        if isinstance(cut, TextNode):
            cut.start_char_idx, cut.end_char_idx = meta["segment_char_range"]
    return cut


def drop_given_text(segments: Sequence[Segment]) -> list[Segment]:
    """``segments`` without the text an earlier node of their document gives: with a splitter
    overlap above half a chunk, segments that do not touch can share text. A node whose range
    is unknown stays whole; a segment left without nodes is dropped.
    """
    ranged = [(_exact_range(node), segment, node) for segment in segments for node in segment.nodes]
    placed = [(span, segment, node) for span, segment, node in ranged if span is not None]
    given: dict[str, int] = {}  # per document: where the text given so far ends
    for (start, end), segment, node in sorted(placed, key=lambda p: (p[1].doc_id, p[0])):
        seen = given.setdefault(segment.doc_id, start)
        if seen > start:
            text = node.get_content()[min(seen, end) - start :]
            segment.nodes = [m for m in segment.nodes if m is not node or text.strip()]
            node.set_content(text)
            node.id_ = _node_id(segment.doc_id, node.metadata["segment_node_ids"], text)
            node.metadata["segment_char_range"] = [min(seen, end), end]
            node.start_char_idx = min(seen, end)  # type: ignore[attr-defined]
        given[segment.doc_id] = max(seen, end)
    return [s for s in segments if s.nodes]


def _exact_range(node: BaseNode) -> tuple[int, int] | None:
    span = node.metadata.get("segment_char_range")
    return (span[0], span[1]) if span and span[1] - span[0] == len(node.get_content()) else None


def free_text(spare: Segment, kept: Sequence[Segment]) -> tuple[int, int] | None:
    """The ``[start, end)`` of a one-chunk ``spare``'s text that no ``kept`` segment gives
    (a neighbour's overlap cut off), or None: inside a segment, or offsets cannot tell.
    """
    node = spare.members[0]
    first, _ = char_span(node)
    lo, hi = 0, len(node.get_content())  # the free part: the whole text, until a segment cuts it
    touching = [s for s in kept if s.touches(spare)]
    for s in touching:
        ranges: list[Any] = [n.metadata.get("segment_char_range") for n in s.nodes]
        if s.start <= spare.start < s.end or first is None or None in ranges:
            return None
        if s.end == spare.start:
            lo = max(lo, ranges[-1][1] - first)
        else:
            hi = min(hi, ranges[0][0] - first)
    return (lo, hi) if lo < hi else None


def _node_id(doc_id: str, member_ids: list[str], text: str) -> str:
    # Named by what it holds, not by positions (renumbered from 0 on every call when only
    # links order the hits): the same chunks and text, the same id; other content, another.
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"rse:{doc_id}\n" + "\n".join([*member_ids, text])))
