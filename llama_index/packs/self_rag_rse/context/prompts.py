"""Prompts of the context components (our words; dsRAG's prompts informed what to ask for).

Each is a ``PromptTemplate`` a component takes as an option, so users can swap in their own.
"""

from __future__ import annotations

from llama_index.core.prompts import PromptTemplate

#: Variables: ``first``, ``last`` (line numbers), ``lines`` (the numbered lines).
SECTIONING_PROMPT = PromptTemplate(
    "You are reading part of a document. Every line starts with its number in square "
    "brackets; blank lines are not shown.\n\n"
    "Divide lines {first} to {last} into consecutive sections. A section is a run of lines "
    "about one topic, usually several paragraphs, never a single line; where the document has "
    "headings, start a section at each heading. Give every section a short title that tells a "
    "reader what the section is about.\n\n"
    "Rules: the first section starts at line {first}; every section starts on the line after "
    "the previous one ends; the last section ends at line {last}; use only the numbers shown.\n\n"
    "Lines:\n{lines}\n"
)

#: Variables: ``text`` (the start of the document).
DOCUMENT_TITLE_PROMPT = PromptTemplate(
    "Here is the beginning of a document.\n\n{text}\n\n"
    "Give the document a short descriptive title of at most ten words. Reply with the title "
    "alone, on one line."
)

#: Variables: ``title``, ``text`` (the start of the document).
DOCUMENT_SUMMARY_PROMPT = PromptTemplate(
    'Here is the beginning of a document titled "{title}".\n\n{text}\n\n'
    'In one sentence, say what the document covers. Begin with "This document" and reply with '
    "that sentence alone."
)

#: Variables: ``title`` (of the document), ``section``, ``text`` (the section's start).
SECTION_SUMMARY_PROMPT = PromptTemplate(
    'Here is the section "{section}" of the document "{title}".\n\n{text}\n\n'
    'In one sentence, say what this section covers. Begin with "This section" and reply with '
    "that sentence alone."
)
