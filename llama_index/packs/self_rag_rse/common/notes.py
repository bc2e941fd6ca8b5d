"""Explanations a component leaves for whoever called it, without coupling the two.

A postprocessor that returns no nodes cannot say why through LlamaIndex's interface. It calls
:func:`record_note`; a caller that wants the reason (the Self-RAG engine, for its trace) wraps
the call in :func:`collect_notes`. The notes live in a context variable, so concurrent queries
(threads or asyncio tasks) never see each other's notes, and nothing is kept when nobody collects.
"""

from __future__ import annotations

import contextvars
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_NOTES: contextvars.ContextVar[list[tuple[str, str]] | None] = contextvars.ContextVar(
    "self_rag_rse_notes", default=None
)


def record_note(source: str, text: str) -> None:
    """Leave ``text`` (why something happened) from ``source`` for the collecting caller."""
    notes = _NOTES.get()
    if notes is not None:
        notes.append((source, text))


@contextmanager
def collect_notes() -> Iterator[list[tuple[str, str]]]:
    """Collect the ``(source, text)`` notes recorded inside the ``with`` block."""
    notes: list[tuple[str, str]] = []
    token = _NOTES.set(notes)
    try:
        yield notes
    finally:
        _NOTES.reset(token)


def print_escaped(*parts: Any) -> None:
    """``print`` for verbose traces: a console that cannot encode the text (cp1252, ASCII) gets
    escapes, not an error raised after all the work and losing the answer.
    """
    encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
    print(" ".join(map(str, parts)).encode(encoding, "backslashreplace").decode(encoding))
