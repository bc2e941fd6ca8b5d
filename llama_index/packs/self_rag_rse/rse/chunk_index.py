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

Each chunk also gets the *version* of its document it was cut from (``chunk_version``: the
document's hash), so RSE never joins chunks of two versions: stable ids overwrite a re-ingested
document's chunks, but a shorter new version leaves the old version's tail in the store.

Indices are positions in the whole document, so :class:`ChunkIndexer` must see whole documents
(it runs right after the splitter). A call holding only part of one (nodes ingested in batches
after splitting) is numbered only as far as its offsets and links vouch for; where they cannot,
it is an error that names the fix, never a second chunk 0.

Given the documents themselves (``ChunkIndexer(documents=documents)``), it also puts every chunk
at its own copy of its text (splitters place a chunk by searching its text, which lands on an
earlier copy where the text repeats) and marks the offsets checked
(:mod:`~llama_index.packs.self_rag_rse.context.placement`), so RSE trusts them in repeated text.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.schema import (
    BaseNode,
    Document,
    NodeRelationship,
    RelatedNodeInfo,
    TransformComponent,
)

from llama_index.packs.self_rag_rse.common.options import pydantic_fields, reject_unknown
from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY
from llama_index.packs.self_rag_rse.context.placement import place_chunks
from llama_index.packs.self_rag_rse.rse.node_fields import char_span, chunk_index, link, source_hash
from llama_index.packs.self_rag_rse.rse.stitching import MAX_LINKED_GAP, MAX_STRIPPED_GAP

#: Metadata key holding a chunk's 0-based position within its source document.
CHUNK_INDEX_KEY = "chunk_index"

#: Metadata key holding the version of its document a chunk was cut from (the document's hash).
CHUNK_VERSION_KEY = "chunk_version"

#: Namespace of :func:`stable_chunk_id` (a fixed, random UUID: ids never change between releases).
STABLE_ID_NAMESPACE = uuid.UUID("c0e4e7a6-5d84-4340-98bf-02103002f0f7")


def stable_chunk_id(doc_id: str, index: int) -> str:
    """The node id :class:`ChunkIndexer` gives chunk ``index`` of document ``doc_id`` with
    ``stable_ids=True``: a UUID (version 5) of the two, valid in every vector store.
    """
    return _stable_id(doc_id, int(index))


@functools.lru_cache(maxsize=1 << 16)
def _stable_id(doc_id: str, index: int) -> str:
    # Cached: RSE asks for the ids of every gap it reads, call after call, and a UUID costs a hash.
    return str(uuid.uuid5(STABLE_ID_NAMESPACE, f"{doc_id}\n{index}"))


class ChunkIndexer(TransformComponent):
    """Write each node's 0-based position within its document into ``metadata[key]``, and the
    version of the document it was cut from into ``metadata[CHUNK_VERSION_KEY]``.

    Put it in an ``IngestionPipeline`` right after the splitter. Nodes are numbered per source
    document (``ref_doc_id``) in ``start_char_idx`` order, or in the order they arrive in (the
    splitter's) when any node lacks an offset. Both keys are excluded from the text that is
    embedded and shown to the LLM, so adding them changes neither embeddings nor prompts. Nodes
    without a source document are left alone, but a whole ``Document`` (the splitter has not
    run: nothing to number), or chunks of two documents (two hashes) with one id, raise
    ``ValueError`` naming the fix.

    A call must hold whole documents. Where it holds part of one (its first chunk here links
    PREVIOUS to a node not in the call; or, with no links, its chunks start further in than a
    document's stripped leading whitespace; or chunks between two members are missing), the indices
    already stamped on those nodes are kept, and without them it raises ``ValueError``: stamp whole
    documents first, then ingest in batches. One missing chunk between two linked members is skipped
    over (its neighbours' links name it), so indices stay true.

    The version is the document's hash as the splitter recorded it on the SOURCE relationship
    (``document.hash``), or a hash of the document's chunk texts when there is none.

    ``documents``: the documents the chunks were cut from (what the pipeline is run on; matched
    by document id). The splitter's offsets come from searching each chunk's text, which lands
    on an earlier copy where the text repeats; with its document at hand, each chunk of a whole
    document is put at its own copy and marked ``chunk_offsets_checked``, when every chunk can
    be (:func:`~llama_index.packs.self_rag_rse.context.placement.place_chunks`), so RSE cuts
    overlaps and refills gaps by them even in repeated text. Otherwise (no documents, a
    document not given, a call holding part of one, another version's text) the splitter's
    offsets are kept, and RSE joins whole the chunks whose boundary repeated text could explain
    another way.

    With ``stable_ids=True`` every numbered node is also renamed to
    :func:`stable_chunk_id` of its document and index, and the relationships (NEXT, PREVIOUS,
    PARENT, CHILD) of the nodes in the same call are rewritten to the new ids; a NEXT/PREVIOUS
    link to a chunk outside the call is pointed at that chunk's stable id. The postprocessor
    then reads the chunks between hits by id (see the module docstring), and re-ingesting a
    document overwrites its chunks instead of adding copies (delete the old version's tail when
    the new one is shorter: see docs/rse.md). Leave it off if something outside the pipeline
    keeps the splitter's node ids (an ``id_func``, references stored elsewhere).

    Example::

        pipeline = IngestionPipeline(
            transformations=[
                SentenceSplitter(),
                ChunkIndexer(stable_ids=True, documents=documents),
                embed_model,
            ],
            vector_store=vector_store,
        )
        pipeline.run(documents=documents)
    """

    key: str = Field(
        default=CHUNK_INDEX_KEY,
        description=(
            "Metadata key to write. RelevantSegmentPostprocessor reads CHUNK_INDEX_KEY (the "
            "default); another key is for your own use."
        ),
    )
    stable_ids: bool = Field(
        default=False,
        description=(
            "Rename each numbered node to a UUID of its document id and chunk index (and "
            "rewrite the relationships among the nodes of the call), so RSE reads the chunks "
            "between hits by id."
        ),
    )

    _texts: dict[str, str] = PrivateAttr(default_factory=dict)

    def __init__(self, *, documents: Iterable[BaseNode] | None = None, **kwargs: Any) -> None:
        # Pydantic would drop a misspelt option silently and use its default.
        reject_unknown(type(self).__name__, kwargs, pydantic_fields(type(self)) | {"documents"})
        super().__init__(**kwargs)
        self._texts = {document.node_id: document.get_content() for document in documents or ()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Core unpickles by calling __init__ again without documents= (IngestionPipeline's
        # workers, num_workers > 1): keep the texts that were pickled.
        super().__setstate__(state)
        self._texts = (state.get("__pydantic_private__") or {}).get("_texts", {})

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "ChunkIndexer"

    def __call__(self, nodes: Sequence[BaseNode], **kwargs: Any) -> Sequence[BaseNode]:
        """Stamp the chunk index and version on every node that has a source document."""
        _refuse_documents(nodes)
        by_document: dict[str, list[tuple[int, BaseNode]]] = defaultdict(list)
        first: dict[str, BaseNode] = {}  # a node id given twice is one chunk: stamped alike
        for arrival, node in enumerate(nodes):
            if node.ref_doc_id is not None and first.setdefault(node.node_id, node) is node:
                by_document[node.ref_doc_id].append((arrival, node))
        _refuse_shared_ids(by_document)
        numbered: dict[str, tuple[str, int]] = {}  # node id -> (document id, chunk index)
        for doc_id, members in by_document.items():
            ordered = _in_order(members)
            indices, whole = self._number(doc_id, ordered)
            fallback = _text_hash(ordered) if whole else None
            if whole and doc_id in self._texts:
                place_chunks(self._texts[doc_id], ordered)
            for node, index in zip(ordered, indices, strict=True):
                version = source_hash(node) or fallback or node.metadata.get(CHUNK_VERSION_KEY)
                self._stamp(node, index, version)
                numbered[node.node_id] = (doc_id, index)
        for node in nodes:
            original = first.get(node.node_id)
            if original is not None and original is not node and node.node_id in numbered:
                self._stamp(
                    node, original.metadata[self.key], original.metadata.get(CHUNK_VERSION_KEY)
                )
        if self.stable_ids and numbered:
            _rename(nodes, numbered)
        return nodes

    def _stamp(self, node: BaseNode, index: int, version: Any) -> None:
        node.metadata[self.key] = index
        if version is not None:
            node.metadata[CHUNK_VERSION_KEY] = version
        for excluded in (node.excluded_embed_metadata_keys, node.excluded_llm_metadata_keys):
            for key in (self.key, CHUNK_VERSION_KEY, OFFSETS_CHECKED_KEY):
                if key not in excluded:
                    excluded.append(key)

    def _number(self, doc_id: str, ordered: list[BaseNode]) -> tuple[list[int], bool]:
        """Each node's index, and whether the call holds the whole document (no link leads out
        of it); indices stamped before are kept where the call cannot vouch for its own, and
        without them it raises.
        """
        ids = {node.node_id for node in ordered}
        indices = [0]
        problem = _missing_start(ordered, ids)
        for left, right in itertools.pairwise(ordered):
            after = link(left, NodeRelationship.NEXT)
            before = link(right, NodeRelationship.PREVIOUS)
            outside = [i for i in (after, before) if i is not None and i not in ids]
            if not outside or after == right.node_id or before == left.node_id:
                indices.append(indices[-1] + 1)
            elif after is not None and after == before:  # both name the one chunk between
                indices.append(indices[-1] + 2)
            else:
                indices.append(indices[-1] + 1)
                problem = problem or (
                    f"chunks between {left.node_id!r} and {right.node_id!r} are not in it "
                    f"({left.node_id!r} links NEXT to {after!r}, {right.node_id!r} PREVIOUS "
                    f"to {before!r})"
                )
        if problem is None:
            leads_out = any(
                link(n, r) not in (None, *ids)
                for n in ordered
                for r in (NodeRelationship.NEXT, NodeRelationship.PREVIOUS)
            )
            return indices, not leads_out
        stamped = [chunk_index(node, self.key) for node in ordered]
        if all(i is not None for i in stamped) and len(set(stamped)) == len(stamped):
            return [int(i) for i in stamped if i is not None], False
        raise ValueError(
            f"ChunkIndexer got only part of document {doc_id!r} in one call: {problem}. "
            "Numbering these chunks from 0 would give them the indices (and, with "
            "stable_ids=True, the ids) of the document's first chunks, and they would "
            "overwrite each other in the store. Fix: stamp indices when splitting whole "
            "documents: run the pipeline on the documents ([splitter, ChunkIndexer(), ...]), "
            "or call ChunkIndexer on all the split nodes at once before ingesting them in "
            "batches (a batch keeps the indices already stamped on its nodes)."
        )


def _refuse_documents(nodes: Sequence[BaseNode]) -> None:
    """Raise when the call holds whole documents: ChunkIndexer was put before the splitter (or
    the splitter was left out), and would stamp nothing without a word; or chunks with
    children, which overlap their own children.
    """
    if documents := [n for n in nodes if isinstance(n, Document) and n.ref_doc_id is None]:
        raise ValueError(
            f"ChunkIndexer got {len(documents)} whole document(s) (e.g. "
            f"{documents[0].node_id!r}, a Document with no source document): it numbers the "
            "chunks of each document, and a document is no chunk, so nothing would be numbered "
            "and RSE would find no positions. Put ChunkIndexer right after the splitter (or "
            "DocumentSectioner): IngestionPipeline(transformations=[SentenceSplitter(), "
            "ChunkIndexer(), embed_model])"
        )
    if parents := [n for n in nodes if n.child_nodes]:  # HierarchicalNodeParser's larger chunks
        raise ValueError(
            f"ChunkIndexer got {len(parents)} node(s) with children (e.g. {parents[0].node_id!r}"
            "): a document's chunks would hold each other, and RSE would join a chunk to text "
            "inside it. Number the leaves only: ChunkIndexer()(get_leaf_nodes(nodes))"
        )


def _refuse_shared_ids(by_document: dict[str, list[tuple[int, BaseNode]]]) -> None:
    """Raise when chunks of different documents (SOURCE hashes differ) share one document id:
    numbered as one document, RSE would join them into one segment.
    """
    for doc_id, members in by_document.items():
        if len({source_hash(node) for _, node in members} - {None}) > 1:
            raise ValueError(
                f"ChunkIndexer got chunks of different documents sharing the id {doc_id!r} "
                "(their SOURCE hashes differ): numbered as one document, RSE would join them "
                "into one segment. Give each document its own id_ "
                "(SimpleDirectoryReader(filename_as_id=True)), or pass one version of it"
            )


def _in_order(members: list[tuple[int, BaseNode]]) -> list[BaseNode]:
    """One document's nodes by offset (ties by arrival), or by arrival when any lacks one."""
    starts = [char_span(node)[0] for _, node in members]
    if all(start is not None for start in starts):
        order = sorted(range(len(members)), key=lambda i: (starts[i], members[i][0]))
        return [members[i][1] for i in order]
    return [node for _, node in members]


def _missing_start(ordered: list[BaseNode], ids: set[str]) -> str | None:
    """Why the call does not hold the document's first chunk, or ``None`` when it may."""
    first = ordered[0]
    before = link(first, NodeRelationship.PREVIOUS)
    if before is not None and before not in ids:
        return f"its first chunk here, {first.node_id!r}, links PREVIOUS to {before!r}"
    if any(
        link(n, r) is not None
        for n in ordered
        for r in (NodeRelationship.NEXT, NodeRelationship.PREVIOUS)
    ):
        return None  # linked chunks, and the first links to no predecessor: it is the first
    if len(ordered) == 1:
        return None  # splitters link chunks that have neighbours: a lone one is the document
    # No links: only the offsets can tell. A splitter strips the document's leading whitespace,
    # so the first chunk may start a little way in: as far as whitespace is stripped at a cut,
    # and less than half a chunk (an earlier chunk would take more room than that).
    starts = [s for s in (char_span(node)[0] for node in ordered) if s is not None]
    shortest = min(len(node.get_content()) for node in ordered)
    leading = min(MAX_LINKED_GAP, max(MAX_STRIPPED_GAP, shortest // 2))
    if starts and min(starts) > leading:
        return f"its chunks start at character {min(starts)}, not at the document's start"
    return None


def _text_hash(ordered: list[BaseNode]) -> str:
    digest = hashlib.sha256()
    for node in ordered:
        digest.update(node.get_content().encode("utf-8", "surrogatepass"))
        digest.update(b"\x00")
    return digest.hexdigest()


def _rename(nodes: Sequence[BaseNode], numbered: dict[str, tuple[str, int]]) -> None:
    """Give numbered nodes their stable ids and point every relationship at the new ids.

    A NEXT/PREVIOUS link to a chunk outside the call names the chunk after/before this one,
    whose index is known: it is pointed at that chunk's stable id, which it will get when its
    own call stamps it.
    """
    renamed = {old: stable_chunk_id(doc_id, i) for old, (doc_id, i) in numbered.items()}
    in_call = {node.node_id for node in nodes}

    def moved(info: RelatedNodeInfo, place: tuple[str, int] | None, step: int) -> RelatedNodeInfo:
        new = renamed.get(info.node_id)
        outside = info.node_id not in in_call
        if new is None and outside and place is not None and step and place[1] + step >= 0:
            new = stable_chunk_id(place[0], place[1] + step)
        return info if new is None else info.model_copy(update={"node_id": new})

    for node in nodes:
        place = numbered.get(node.node_id)
        for relation, related in list(node.relationships.items()):
            step = {NodeRelationship.NEXT: 1, NodeRelationship.PREVIOUS: -1}.get(relation, 0)
            if isinstance(related, list):
                node.relationships[relation] = [moved(info, None, 0) for info in related]
            else:
                node.relationships[relation] = moved(related, place, step)
        if node.node_id in renamed:
            node.node_id = renamed[node.node_id]
