"""Metadata keys written by the context components, in one place, and a reader of the section path.

The sectioner writes the ``section_*`` keys and ``document_heading`` on every chunk (and
``chunk_offsets_checked`` where it placed a section's chunks in its text); the header
component writes ``document_title``, the summaries and ``context_header``; RSE's segment nodes get
``segment_header``. All but the two headers are hidden from the embedded and the LLM text: the
headers are how that context reaches the embedding model (per chunk) and the answer LLM (once per
segment).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: Title of the chunk's innermost section (``""`` for text before the first heading).
SECTION_TITLE_KEY = "section_title"
#: Titles from the outermost section down to the chunk's own (the document title left out).
SECTION_PATH_KEY = "section_path"
#: ``[start, end)`` character offsets of the chunk's section in its document.
SECTION_RANGE_KEY = "section_range"
#: 0-based position of the section in its document.
SECTION_INDEX_KEY = "section_index"
#: How the section was found: ``"headings"``, ``"llm"``, or ``"headings (llm rejected)"``.
SECTION_SOURCE_KEY = "section_source"
#: The document's own title heading, when it opens with one (the headings strategy finds it).
DOCUMENT_HEADING_KEY = "document_heading"
#: The document title used in headers; a value the user sets on the Document wins.
DOCUMENT_TITLE_KEY = "document_title"
#: One-sentence document summary (LLM), when asked for.
DOCUMENT_SUMMARY_KEY = "document_summary"
#: One-sentence section summary (LLM), when asked for.
SECTION_SUMMARY_KEY = "section_summary"
#: The composed chunk header: embedded with the chunk text, hidden from the answer LLM.
HEADER_KEY = "context_header"
#: The header of an RSE segment: shown to the answer LLM once, before the segment text.
SEGMENT_HEADER_KEY = "segment_header"
#: ``True`` on a chunk whose offsets were found again in its document's text (see
#: :mod:`~.placement`): RSE trusts them even where the text repeats.
OFFSETS_CHECKED_KEY = "chunk_offsets_checked"

#: Keys the sectioner writes.
SECTION_KEYS = (
    SECTION_TITLE_KEY,
    SECTION_PATH_KEY,
    SECTION_RANGE_KEY,
    SECTION_INDEX_KEY,
    SECTION_SOURCE_KEY,
    DOCUMENT_HEADING_KEY,
    OFFSETS_CHECKED_KEY,
)


def section_path(metadata: Mapping[str, Any]) -> tuple[str, ...]:
    """The section path in ``metadata``: a list or tuple of texts; a text (set by a reader, not
    the sectioner) is one title; anything else (numpy arrays included) is no path.
    """
    value = metadata.get(SECTION_PATH_KEY)
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
        return ()
    return tuple(value)
