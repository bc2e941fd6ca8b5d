"""Split documents into titled sections that follow their structure, then chunk each section.

Chunks that cross a section boundary mix two topics and cannot carry one section title, so the
sectioner does the chunking itself: it cuts every document into sections (by its headings, or by an
LLM reading numbered lines) and runs the splitter on each section on its own. Every chunk keeps the
true offsets, source document and NEXT/PREVIOUS links it would have had from the splitter alone
(links run across section boundaries, so RSE can still join neighbouring sections), and gains
``section_title``, ``section_path``, ``section_range`` (characters), ``section_index``,
``section_source`` and ``document_heading`` (the document's own title heading). Those keys are
hidden from the embedded and the LLM text; :class:`ContextualHeaders` turns them into a header.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from llama_index.core.async_utils import run_jobs
from llama_index.core.bridge.pydantic import Field, SerializeAsAny
from llama_index.core.llms import LLM
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import (
    BaseNode,
    Document,
    MetadataMode,
    NodeRelationship,
    TextNode,
    TransformComponent,
)

from llama_index.packs.self_rag_rse.context.cache import ContextCache, model_id
from llama_index.packs.self_rag_rse.context.component import (
    ContextComponent,
    ContextUsage,
    check_documents,
)
from llama_index.packs.self_rag_rse.context.headings import heading_sections
from llama_index.packs.self_rag_rse.context.keys import (
    DOCUMENT_HEADING_KEY,
    SECTION_INDEX_KEY,
    SECTION_KEYS,
    SECTION_PATH_KEY,
    SECTION_RANGE_KEY,
    SECTION_SOURCE_KEY,
    SECTION_TITLE_KEY,
)
from llama_index.packs.self_rag_rse.context.llm_sections import llm_section_starts
from llama_index.packs.self_rag_rse.context.placement import place_chunks
from llama_index.packs.self_rag_rse.context.prompts import SECTIONING_PROMPT
from llama_index.packs.self_rag_rse.context.sections import (
    LineIndex,
    Section,
    SectionStart,
    sections_from_starts,
)

logger = logging.getLogger(__name__)


@dataclass
class _Plan:
    sections: list[Section]
    heading: str | None
    source: str


class DocumentSectioner(ContextComponent):
    """Cut documents into titled sections and chunk each section with ``splitter``.

    It takes the splitter's place in an ``IngestionPipeline``: documents in, chunks out, no chunk
    crossing a section boundary. Nodes that are already chunks (a splitter ran before it) raise
    ``ValueError``: their sections would get offsets inside the chunk. Two strategies:

    - ``"headings"`` (default; offline, free, deterministic): sections start at the document's
      headings (Markdown ``#``, reST/pydoc underlines, numbered headings) and are titled by them,
      nested headings giving paths such as ``("The match statement", "OR Patterns")``;
    - ``"llm"``: the LLM reads the lines, numbered, ``window_chars`` characters at a time, and
      returns titled sections through structured output; each answer is checked and repaired
      (ordered, unique, inside the window, covering it from its first line). An answer that
      cannot be repaired raises an error naming the document and window, or, with
      ``on_invalid="fallback"`` (default), that window uses its headings and the reason is
      logged and kept in :attr:`usage`. Results are cached per document (content hash, model,
      prompt, window settings): re-ingesting an unchanged document costs no LLM call. A result
      that fell back to headings is cached too (clear the cache to ask again).

    With ``splitter=None`` every section becomes one node.

    Example::

        pipeline = IngestionPipeline(transformations=[
            DocumentSectioner(splitter=SentenceSplitter(chunk_size=256, chunk_overlap=20)),
            ChunkIndexer(),
            ContextualHeaders(),
            embed_model,
        ])
    """

    strategy: Literal["headings", "llm"] = Field(
        default="headings",
        description="'headings': the document's own headings (offline); 'llm': an LLM reads it.",
    )
    splitter: SerializeAsAny[TransformComponent] | None = Field(
        default_factory=SentenceSplitter,
        description="Splits each section into chunks; None makes each section one node.",
    )
    llm: SerializeAsAny[LLM] | None = Field(
        default=None, description="LLM of the 'llm' strategy (required there, unused otherwise)."
    )
    numbered_headings: bool = Field(
        default=True,
        description="Also take short numbered lines ('2.1 Scope') between blank lines as headings.",
    )
    window_chars: int = Field(
        default=12_000,
        description=(
            "Characters of numbered lines the LLM reads at once. Smaller windows suit models "
            "with short contexts and cost more calls."
        ),
    )
    max_line_chars: int = Field(
        default=240, description="Each line shown to the LLM is cut to this many characters."
    )
    min_section_lines: int = Field(
        default=2,
        description=(
            "LLM sections with fewer non-blank lines are merged into the next one; an answer "
            "made mostly of such pieces is rejected."
        ),
    )
    on_invalid: Literal["fallback", "raise"] = Field(
        default="fallback",
        description=(
            "An LLM answer that cannot be repaired: 'fallback' uses the window's headings (and "
            "logs why), 'raise' stops with an error naming the document and window."
        ),
    )
    num_workers: int = Field(default=4, description="Documents sectioned by the LLM at once.")
    sectioning_prompt: SerializeAsAny[BasePromptTemplate] = Field(
        default=SECTIONING_PROMPT,
        description="Prompt of the 'llm' strategy, with {first}, {last} and {lines}.",
    )

    _minimums: ClassVar[dict[str, int]] = {
        "window_chars": 200,
        "max_line_chars": 20,
        "min_section_lines": 1,
        "num_workers": 1,
    }

    def _check_options(self) -> None:
        if self.strategy == "llm" and self.llm is None:
            raise ValueError(
                f"{type(self).__name__}(strategy='llm') needs an llm: pass llm=<a LlamaIndex LLM>, "
                "or use strategy='headings' (offline)"
            )

    async def _transform(
        self, nodes: Sequence[BaseNode], show_progress: bool
    ) -> Sequence[BaseNode]:
        """Documents in, section-bounded chunks out; LLM calls for several documents run
        concurrently.
        """
        check_documents(type(self).__name__, nodes)
        self._usage = ContextUsage(documents=len(nodes))
        if self.strategy == "headings":
            plans = [self._heading_plan(node) for node in nodes]
        else:
            jobs = [self._llm_plan(node) for node in nodes]
            try:
                plans = await run_jobs(
                    jobs, show_progress, workers=self.num_workers, desc="Sectioning documents (LLM)"
                )
            finally:  # what was paid for is kept, also when a later call fails (or Ctrl-C)
                self._cache.persist()
            if rejected := self._usage.rejected:
                logger.warning(
                    "DocumentSectioner: the LLM's sections were rejected in %d window(s); those "
                    "windows use the document's headings instead. First: %s. Fix: a stronger "
                    "model or smaller window_chars (see DocumentSectioner.usage.rejected for all).",
                    len(rejected),
                    rejected[0],
                )
        return self._chunk(nodes, plans, show_progress)

    # -- sectioning ---------------------------------------------------------------------------
    def _heading_plan(self, node: BaseNode) -> _Plan:
        sections, heading = self.sections(node.get_content(metadata_mode=MetadataMode.NONE))
        return _Plan(sections, heading, "headings")

    def sections(self, text: str) -> tuple[list[Section], str | None]:
        """The sections of ``text`` by its headings, and its title heading (no LLM)."""
        return heading_sections(text, numbered=self.numbered_headings)

    async def _llm_plan(self, node: BaseNode) -> _Plan:
        text = node.get_content(metadata_mode=MetadataMode.NONE)
        index = LineIndex(text)
        structural, heading = self.sections(text)
        llm = self.llm
        key = ContextCache.key(
            "sections",
            text,
            model_id(llm),
            self.sectioning_prompt.get_template(),
            self.window_chars,
            self.max_line_chars,
            self.min_section_lines,
        )
        cached = await self._cache.aget("sections", key)
        if cached is not None and cached.get("rejected") and self.on_invalid == "raise":
            cached = None  # that answer fell back to headings: ask again, and raise this time
        if cached is not None:
            self._usage.cached += 1
        else:
            found = await llm_section_starts(
                index,
                llm,
                self.sectioning_prompt,
                window_chars=self.window_chars,
                max_line_chars=self.max_line_chars,
                min_section_lines=self.min_section_lines,
                on_invalid=self.on_invalid,
                fallback=lambda first, last: _structural_starts(structural, first, last),
                name=_name(node),
            )
            self._usage.llm_calls += found.calls
            self._usage.repairs.extend(found.repairs)
            joined = _join_continued([_start(s.line, s.title) for s in found.starts])
            cached = {"starts": [[s.line, s.title] for s in joined], "rejected": found.rejected}
            await self._cache.aput("sections", key, cached)
        starts = [_start(line, title) for line, title in cached["starts"]]
        rejected = list(cached.get("rejected", []))
        self._usage.rejected.extend(rejected)
        source = "llm" if not rejected else "llm, headings where rejected"
        return _Plan(sections_from_starts(index, starts), heading, source)

    def _chunk(
        self, nodes: Sequence[BaseNode], plans: list[_Plan], show_progress: bool
    ) -> list[BaseNode]:
        pieces: list[Document] = []
        owner: dict[str, tuple[BaseNode, Section, int, _Plan]] = {}
        for node, plan in zip(nodes, plans, strict=True):
            text = node.get_content(metadata_mode=MetadataMode.NONE)
            for k, section in enumerate(plan.sections):
                piece_id = f"{node.node_id}#section-{k}"
                owner[piece_id] = (node, section, k, plan)
                pieces.append(
                    Document(
                        id_=piece_id,
                        text=text[section.start_char : section.end_char],
                        metadata={**node.metadata, **_section_metadata(section, k, plan)},
                        excluded_embed_metadata_keys=_hide(node.excluded_embed_metadata_keys),
                        excluded_llm_metadata_keys=_hide(node.excluded_llm_metadata_keys),
                        metadata_template=node.metadata_template,
                        metadata_separator=node.metadata_separator,
                    )
                )
        if self.splitter is None:
            chunks: list[BaseNode] = [
                TextNode(
                    text=piece.text,
                    metadata=dict(piece.metadata),
                    excluded_embed_metadata_keys=list(piece.excluded_embed_metadata_keys),
                    excluded_llm_metadata_keys=list(piece.excluded_llm_metadata_keys),
                    relationships={NodeRelationship.SOURCE: piece.as_related_node_info()},
                    start_char_idx=0,
                    end_char_idx=len(piece.text),
                )
                for piece in pieces
                if piece.text.strip()
            ]
            link = True
        else:
            chunks = list(self.splitter(pieces, show_progress=show_progress))
            link = bool(getattr(self.splitter, "include_prev_next_rel", True))
            _repair_offsets(chunks, {piece.node_id: piece.text for piece in pieces})
        by_document: dict[str, list[BaseNode]] = {}
        for chunk in chunks:
            source_id = chunk.ref_doc_id
            if source_id is None or source_id not in owner:
                raise ValueError(
                    f"{type(self).__name__}: the splitter returned a node whose source is "
                    f"{source_id!r}, not one of the sections it was given; use a splitter that "
                    "keeps each node's source document (any LlamaIndex NodeParser does)"
                )
            document, section, k, plan = owner[source_id]
            self._place(chunk, document, section, k, plan)
            by_document.setdefault(document.node_id, []).append(chunk)
        if link:
            for members in by_document.values():
                _relink(members)
        return [chunk for members in by_document.values() for chunk in members]

    def _place(
        self, chunk: BaseNode, document: BaseNode, section: Section, k: int, plan: _Plan
    ) -> None:
        """Move ``chunk`` from its section onto its document: offsets, source, metadata."""
        if isinstance(chunk, TextNode):
            if chunk.start_char_idx is not None:
                chunk.start_char_idx += section.start_char
            if chunk.end_char_idx is not None:
                chunk.end_char_idx += section.start_char
        source = document.source_node or document.as_related_node_info()
        chunk.relationships[NodeRelationship.SOURCE] = source
        chunk.metadata.update(_section_metadata(section, k, plan))
        chunk.excluded_embed_metadata_keys = _hide(chunk.excluded_embed_metadata_keys)
        chunk.excluded_llm_metadata_keys = _hide(chunk.excluded_llm_metadata_keys)


def _repair_offsets(chunks: Sequence[BaseNode], texts: dict[str, str]) -> None:
    """Put each section's chunks at their own copies of their text and mark them checked
    (:func:`~.placement.place_chunks`: splitters place a chunk by searching its text, which can
    land on an earlier copy of repeated text).
    """
    by_piece: dict[str, list[BaseNode]] = {}
    for chunk in chunks:
        if chunk.ref_doc_id in texts:
            by_piece.setdefault(chunk.ref_doc_id, []).append(chunk)
    for piece, members in by_piece.items():
        place_chunks(texts[piece], members)


def _structural_starts(structural: list[Section], first: int, last: int) -> list[SectionStart]:
    """The heading sections of lines ``first..last``, the first one continuing the section that
    holds ``first`` (a window rarely starts on a heading).
    """
    return [
        SectionStart(max(first, section.start_line), section.title, section.path[-1:])
        for section in structural
        if section.end_line > first and section.start_line <= last
    ]


def _join_continued(starts: list[SectionStart]) -> list[SectionStart]:
    """Drop starts that only continue the section before them (same title): a window boundary
    is not a section boundary.
    """
    joined: list[SectionStart] = []
    for start in starts:
        if joined and start.title == joined[-1].title and start.path == joined[-1].path:
            continue
        joined.append(start)
    return joined


def _start(line: int, title: str) -> SectionStart:
    """An LLM section's start: its title is its path (the LLM gives no nesting)."""
    return SectionStart(line, title, (title,) if title else ())


def _section_metadata(section: Section, k: int, plan: _Plan) -> dict[str, Any]:
    return {
        SECTION_TITLE_KEY: section.title,
        SECTION_PATH_KEY: list(section.path),
        SECTION_RANGE_KEY: [section.start_char, section.end_char],
        SECTION_INDEX_KEY: k,
        SECTION_SOURCE_KEY: plan.source,
        DOCUMENT_HEADING_KEY: plan.heading or "",
    }


def _hide(excluded: list[str]) -> list[str]:
    return list(excluded) + [key for key in SECTION_KEYS if key not in excluded]


def _relink(members: list[BaseNode]) -> None:
    """NEXT/PREVIOUS links across the whole document (chunks arrive in document order)."""
    for i, node in enumerate(members):
        node.relationships.pop(NodeRelationship.PREVIOUS, None)
        node.relationships.pop(NodeRelationship.NEXT, None)
        if i > 0:
            node.relationships[NodeRelationship.PREVIOUS] = members[i - 1].as_related_node_info()
        if i + 1 < len(members):
            node.relationships[NodeRelationship.NEXT] = members[i + 1].as_related_node_info()


def _name(node: BaseNode) -> str:
    name = node.metadata.get("file_name") or node.metadata.get("file_path") or node.node_id
    return f"document {name!r}"
