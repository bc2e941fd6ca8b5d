"""Contextual chunk headers: say which document and section a chunk is from, in its embedding.

dsRAG's observation: a chunk rarely names what it is about ("the treatment is X" without the
disease), so questions naming the topic miss it. A short header naming the document and the
section, embedded with the chunk, fixes that. The answer LLM should not read it once per chunk,
so the header lives in metadata that core's machinery embeds but leaves out of the LLM text::

    node.get_content(MetadataMode.EMBED)  ->  "Document: ...\\nSection: ...\\n\\n<chunk text>"
    node.get_content(MetadataMode.LLM)    ->  "<chunk text>"

(``metadata_template="{value}"``, every other key excluded from the embedded text, every key
excluded from the LLM text). RSE segments carry the header once, before the segment text: see
:func:`~llama_index.packs.self_rag_rse.context.segment_header.add_segment_header`.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Sequence
from pathlib import PurePath
from typing import Any, ClassVar, Literal

from llama_index.core.async_utils import run_jobs
from llama_index.core.bridge.pydantic import Field, SerializeAsAny
from llama_index.core.llms import LLM
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.schema import BaseNode, MetadataMode

from llama_index.packs.self_rag_rse.context.cache import ContextCache, model_id
from llama_index.packs.self_rag_rse.context.component import (
    ContextComponent,
    ContextUsage,
    check_chunks,
)
from llama_index.packs.self_rag_rse.context.compose import compose_header, section_label
from llama_index.packs.self_rag_rse.context.keys import (
    DOCUMENT_HEADING_KEY,
    DOCUMENT_SUMMARY_KEY,
    DOCUMENT_TITLE_KEY,
    HEADER_KEY,
    SECTION_INDEX_KEY,
    SECTION_SUMMARY_KEY,
    section_path,
)
from llama_index.packs.self_rag_rse.context.prompts import (
    DOCUMENT_SUMMARY_PROMPT,
    DOCUMENT_TITLE_PROMPT,
    SECTION_SUMMARY_PROMPT,
)

TitleSource = Literal["metadata", "heading", "llm", "file_name"]
#: Longest title and summary kept from an LLM answer.
MAX_TITLE_CHARS = 120
MAX_SUMMARY_CHARS = 300


class ContextualHeaders(ContextComponent):
    """Compose each chunk's header (document title, optional summaries, section) for embedding.

    Put it after the sectioner (or any splitter) and :class:`ChunkIndexer`, right before the
    embedding model; whole documents (a reader's ``Document``, before the splitter) raise
    ``ValueError``. The document title comes from the first of ``title_sources`` that has one:

    - ``"metadata"``: the first of ``title_keys`` set on the document (a title you give wins);
    - ``"heading"``: the document's own title heading, found by :class:`DocumentSectioner`;
    - ``"llm"``: asked of ``llm`` from the start of the document (only when ``llm`` is given);
    - ``"file_name"``: the file name without extension, ``_`` and ``-`` read as spaces.

    ``document_summary`` / ``section_summary`` add one LLM sentence each (they need ``llm``).
    LLM results are cached per document and section (content hash, model, prompt), so
    re-ingesting unchanged documents costs no call; calls run ``num_workers`` at a time, with a
    progress bar when the pipeline runs with ``show_progress=True``. Without ``llm`` the
    component makes no model call at all.

    The header is written to ``metadata[header_key]``, embedded with the text and hidden from the
    LLM; every other metadata key (file paths included) is excluded from the embedded text, and
    every key from the LLM text, so the answer LLM sees the bare chunk. Set ``file_path``-style
    keys you want in prompts on the segment or response level instead.
    """

    llm: SerializeAsAny[LLM] | None = Field(
        default=None, description="LLM for titles (when asked) and summaries; None: no LLM."
    )
    title_sources: list[TitleSource] | None = Field(
        default=None,
        description=(
            "Where the document title comes from, first that has one wins. Default: metadata, "
            "heading, llm (only when an llm is given), file_name."
        ),
    )
    title_keys: list[str] = Field(
        default_factory=lambda: [DOCUMENT_TITLE_KEY, "title"],
        description="Metadata keys holding a title you give, in order.",
    )
    document_summary: bool = Field(
        default=False, description="Add a one-sentence document summary (one LLM call each)."
    )
    section_summary: bool = Field(
        default=False, description="Add a one-sentence section summary (one LLM call each)."
    )
    include_section: bool = Field(
        default=True, description="Name the chunk's section (path of titles) in the header."
    )
    max_llm_chars: int = Field(
        default=6_000,
        description="Characters of a document or section the LLM reads for a title or summary.",
    )
    header_key: str = Field(default=HEADER_KEY, description="Metadata key of the header.")
    num_workers: int = Field(default=4, description="LLM calls in flight at once.")
    title_prompt: SerializeAsAny[BasePromptTemplate] = Field(
        default=DOCUMENT_TITLE_PROMPT, description="Prompt for a title, with {text}."
    )
    document_summary_prompt: SerializeAsAny[BasePromptTemplate] = Field(
        default=DOCUMENT_SUMMARY_PROMPT,
        description="Prompt for a document summary, with {title} and {text}.",
    )
    section_summary_prompt: SerializeAsAny[BasePromptTemplate] = Field(
        default=SECTION_SUMMARY_PROMPT,
        description="Prompt for a section summary, with {title}, {section} and {text}.",
    )

    _minimums: ClassVar[dict[str, int]] = {"max_llm_chars": 1, "num_workers": 1}

    def _check_options(self) -> None:
        name = type(self).__name__
        if self.llm is None:
            wanted = [o for o in ("document_summary", "section_summary") if getattr(self, o)]
            if wanted or "llm" in (self.title_sources or []):
                asked = ", ".join(wanted + (["title_sources 'llm'"] if not wanted else []))
                raise ValueError(
                    f"{name}: {asked} needs an llm: pass llm=<a LlamaIndex LLM>, or leave it "
                    "out for headers made without a model"
                )
        if self.title_sources is not None and not self.title_sources:
            raise ValueError(f"{name}: title_sources is empty: name at least one source")

    async def _transform(
        self, nodes: Sequence[BaseNode], show_progress: bool
    ) -> Sequence[BaseNode]:
        """Write the header of every node."""
        check_chunks(type(self).__name__, nodes)
        documents = _by_document(nodes)
        self._usage = ContextUsage(documents=len(documents))
        titles = {doc: self._given_title(members) for doc, members in documents.items()}
        need_title = [doc for doc, title in titles.items() if title is None]
        try:
            found = await self._run(
                [self._ask("title", documents[doc], MAX_TITLE_CHARS) for doc in need_title],
                show_progress,
                "Titles",
            )
            for doc, title in zip(need_title, found, strict=True):
                titles[doc] = title or _file_title(documents[doc])
            # Summaries keyed (document, None) for a document's, (document, section) a section's.
            jobs: dict[tuple[str, Any], Awaitable[str]] = {}
            for doc, members in documents.items():
                if self.document_summary:
                    jobs[doc, None] = self._ask(
                        "document_summary", members, MAX_SUMMARY_CHARS, title=titles[doc] or ""
                    )
                if self.section_summary:
                    for section, part in _by_section(members).items():
                        jobs[doc, section] = self._llm_section_summary(titles[doc] or "", part)
            found = await self._run(list(jobs.values()), show_progress, "Summaries")
            summaries = dict(zip(jobs, found, strict=True))
        finally:  # what was paid for is kept, also when a later call fails (or Ctrl-C)
            self._cache.persist()
        for doc, members in documents.items():
            for node in members:
                self._write(
                    node,
                    titles[doc] or "",
                    summaries.get((doc, None)),
                    summaries.get((doc, _section_of(node))),
                )
        return nodes

    # -- titles and summaries -------------------------------------------------------------------
    def _sources(self) -> list[str]:
        if self.title_sources is not None:
            return list(self.title_sources)
        return ["metadata", "heading", *(["llm"] if self.llm is not None else []), "file_name"]

    def _given_title(self, members: list[BaseNode]) -> str | None:
        """The title from the sources before 'llm'; ``None`` when the LLM must be asked."""
        metadata = members[0].metadata
        for source in self._sources():
            if source in ("metadata", "heading"):
                for key in self.title_keys if source == "metadata" else [DOCUMENT_HEADING_KEY]:
                    value = metadata.get(key)
                    if isinstance(value, str) and value.strip():
                        return value.strip()
            elif source == "llm":
                return None
            elif source == "file_name":
                return _file_title(members)
            else:
                raise ValueError(
                    f"{type(self).__name__}: unknown title source {source!r}; use metadata, "
                    "heading, llm or file_name"
                )
        return ""

    async def _llm_section_summary(self, title: str, members: list[BaseNode]) -> str:
        label = section_label(section_path(members[0].metadata))
        if not label:
            return ""
        return await self._ask(
            "section_summary", members, MAX_SUMMARY_CHARS, title=title, section=label
        )

    async def _ask(self, kind: str, members: list[BaseNode], limit: int, **variables: str) -> str:
        """The first line (at most ``limit`` characters) of the LLM's answer to the ``kind``
        prompt about ``members``; from the cache when asked of the same model before.
        """
        assert self.llm is not None
        prompt: BasePromptTemplate = getattr(self, f"{kind}_prompt")
        variables["text"] = _joined_text(members)[: self.max_llm_chars]
        key = ContextCache.key(kind, model_id(self.llm), prompt.get_template(), variables)
        cached = await self._cache.aget(kind, key)
        if cached is not None:
            self._usage.cached += 1
            text = str(cached["text"])
        else:
            self._usage.llm_calls += 1
            text = await self.llm.apredict(prompt, **variables)
            await self._cache.aput(kind, key, {"text": text})
        return _first_line(text, limit)

    async def _run(self, jobs: list[Awaitable[Any]], show_progress: bool, what: str) -> list[Any]:
        if not jobs:
            return []
        return await run_jobs(
            jobs,  # type: ignore[arg-type]
            show_progress=show_progress,
            workers=self.num_workers,
            desc=f"{what} (LLM)",
        )

    # -- writing ------------------------------------------------------------------------------
    def _write(
        self, node: BaseNode, title: str, summary: str | None, section_summary: str | None
    ) -> None:
        path = section_path(node.metadata) if self.include_section else ()
        header = compose_header(
            title, summary, path, section_summary if self.include_section else None
        )
        node.metadata[DOCUMENT_TITLE_KEY] = title
        if summary is not None:
            node.metadata[DOCUMENT_SUMMARY_KEY] = summary
        if section_summary is not None:
            node.metadata[SECTION_SUMMARY_KEY] = section_summary
        if not header:
            node.metadata.pop(self.header_key, None)
        else:
            node.metadata[self.header_key] = header
        # The embedded text is the header and the chunk; the LLM text is the chunk alone.
        node.metadata_template = "{value}"
        node.excluded_embed_metadata_keys = [k for k in node.metadata if k != self.header_key]
        node.excluded_llm_metadata_keys = list(node.metadata)


def _by_document(nodes: Sequence[BaseNode]) -> dict[str, list[BaseNode]]:
    documents: dict[str, list[BaseNode]] = {}
    for node in nodes:
        documents.setdefault(node.ref_doc_id or node.node_id, []).append(node)
    return documents


def _section_of(node: BaseNode) -> Any:
    index = node.metadata.get(SECTION_INDEX_KEY)
    return index if index is not None else section_path(node.metadata)


def _by_section(members: list[BaseNode]) -> dict[Any, list[BaseNode]]:
    sections: dict[Any, list[BaseNode]] = {}
    for node in members:
        if section_path(node.metadata):
            sections.setdefault(_section_of(node), []).append(node)
    return sections


def _joined_text(members: list[BaseNode]) -> str:
    """The text the chunks cover, overlaps removed where offsets say where each chunk lies."""
    spans = [(getattr(n, "start_char_idx", None), n) for n in members]
    if not all(start is not None for start, _ in spans):
        return "\n".join(n.get_content(metadata_mode=MetadataMode.NONE) for n in members)
    parts: list[str] = []
    cursor: int | None = None  # where the text joined so far ends in the document
    for start, node in sorted(spans, key=lambda s: s[0]):  # type: ignore[arg-type, return-value]
        text = node.get_content(metadata_mode=MetadataMode.NONE)
        assert start is not None
        cursor = start if cursor is None else cursor
        parts.append(("\n" if start > cursor else "") + text[max(0, cursor - start) :])
        cursor = max(cursor, start + len(text))
    return "".join(parts)


def _file_title(members: list[BaseNode]) -> str:
    for key in ("file_name", "file_path", "filename", "source"):
        value = members[0].metadata.get(key)
        if isinstance(value, str) and value.strip():
            stem = PurePath(value).stem or value
            return " ".join(stem.replace("_", " ").replace("-", " ").split())
    doc_id = members[0].ref_doc_id or ""  # a generated id (a UUID) names nothing: no title
    return "" if re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}", doc_id) else doc_id


def _first_line(answer: str, limit: int) -> str:
    marks = " \"'`*#"  # quotes and Markdown emphasis a chat model puts around its answer
    cleaned = [" ".join(line.split()).strip(marks) for line in str(answer).splitlines()]
    lines = [text for text in cleaned if text]
    for at, text in enumerate(lines):
        label, colon, rest = text.partition(":")
        if colon and label.strip(marks).lower() in ("title", "summary"):  # **Title:** Herons
            text = rest.strip(marks)
        if text and not (text.endswith(":") and at + 1 < len(lines)):  # "Here is a summary:"
            return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + "…"
    return ""
