"""The question set: JSON lines in the retrieval-quality benchmark's format, read and checked.

Each line of the ``--qa`` file is an object with ``question`` and, optionally, ``document`` (a
file name in the ``--docs`` folder), ``evidence`` (text copied verbatim from that file: the gold
passage for evidence recall/precision) and ``reference`` (a reference answer, for RAGAS context
recall and LlamaIndex correctness). Problems are reported all at once, each with its line number,
before any model is loaded.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from llama_index.packs.self_rag_rse.evaluation.evidence import Span, find_span

#: File types read from the ``--docs`` folder (as the demo).
DOCUMENT_SUFFIXES = (".txt", ".md")

_KEYS = {"question", "document", "evidence", "reference"}


@dataclass(frozen=True)
class Question:
    """One question of the set.

    ``evidence_span`` is where ``evidence`` lies in ``document`` (set by :func:`load_questions`
    when the documents are given); evidence recall/precision are computed only when it is set.
    """

    question: str
    document: str | None = None
    evidence: str | None = None
    reference: str | None = None
    evidence_span: Span | None = None


def read_documents(folder: str | Path) -> dict[str, str]:
    """The ``.txt``/``.md`` files under ``folder``, keyed by path relative to it (``a/b.txt``)."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--docs {root} is not a folder: pass a folder of .txt or .md files")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in DOCUMENT_SUFFIXES)
    if not files:
        raise ValueError(f"no .txt or .md files under {root}: pass --docs with some text files")
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in files}


def resolve_document(name: str, documents: Mapping[str, str]) -> str | None:
    """The key of ``documents`` that ``name`` designates: itself, or a unique file name match."""
    if name in documents:
        return name
    wanted = Path(name).name
    matches = [key for key in documents if Path(key).name == wanted]
    return matches[0] if len(matches) == 1 else None


def load_questions(
    path: str | Path, documents: Mapping[str, str] | None = None, limit: int | None = None
) -> list[Question]:
    """Read a JSON-lines question set; with ``documents``, locate every ``evidence`` in its file.

    Raises ``ValueError`` listing every bad line (not JSON, no ``question``, unknown keys,
    ``evidence`` without ``document``, a document not in the folder, evidence not found in it).
    Blank lines are skipped; ``limit`` keeps the first questions only.
    """
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"--qa {source} does not exist: pass a .jsonl file of questions")
    questions: list[Question] = []
    problems: list[str] = []
    for number, line in enumerate(source.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as error:
            problems.append(f"line {number}: not JSON ({error.msg})")
            continue
        problem = _check(item, documents)
        if problem:
            problems.append(f"line {number}: {problem}")
            continue
        questions.append(_question(item, documents))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"{source} has {len(problems)} bad line(s):\n  {shown}{more}")
    if not questions:
        raise ValueError(f"{source} holds no question: one JSON object per line")
    return questions[:limit] if limit is not None else questions


def _check(item: object, documents: Mapping[str, str] | None) -> str | None:
    if not isinstance(item, dict):
        return "each line must be a JSON object"
    question = item.get("question")
    if not isinstance(question, str) or not question.strip():
        return 'no "question" (a non-empty string)'
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        return f"unknown key(s) {unknown}; allowed: {sorted(_KEYS)}"
    for key in ("document", "evidence", "reference"):
        if item.get(key) is not None and not isinstance(item[key], str):
            return f'"{key}" must be a string'
    if item.get("evidence") and not item.get("document"):
        return '"evidence" needs "document" (the file it is copied from)'
    if documents is not None and item.get("document"):
        name = resolve_document(item["document"], documents)
        if name is None:
            return f"document {item['document']!r} is not a file in --docs"
        if item.get("evidence") and find_span(documents[name], item["evidence"]) is None:
            return f"the evidence is not in {name} (it must be copied verbatim from the file)"
    return None


def _question(item: dict[str, str], documents: Mapping[str, str] | None) -> Question:
    document = item.get("document") or None
    span = None
    if documents is not None and document:
        document = resolve_document(document, documents)
        evidence = item.get("evidence")
        if evidence and document is not None:
            found = find_span(documents[document], evidence)
            span = (document, *found) if found else None
    return Question(
        question=item["question"].strip(),
        document=document,
        evidence=item.get("evidence") or None,
        reference=item.get("reference") or None,
        evidence_span=span,
    )


def questions_from(
    items: Iterable[str | Question], documents: Mapping[str, str] | None = None
) -> list[Question]:
    """``Question`` objects from plain strings or questions (the API accepts both).

    With ``documents``, a question that names its ``document`` and ``evidence`` but has no
    ``evidence_span`` yet gets one; evidence that cannot be found raises ``ValueError``.
    """
    out = []
    for item in items:
        question = item if isinstance(item, Question) else Question(question=str(item))
        if documents is not None and question.evidence and question.evidence_span is None:
            problem = _check(
                {
                    "question": question.question,
                    "document": question.document,
                    "evidence": question.evidence,
                },
                documents,
            )
            if problem:
                raise ValueError(f"question {question.question!r}: {problem}")
            placed = _question(
                {
                    "question": question.question,
                    "document": question.document or "",
                    "evidence": question.evidence,
                    "reference": question.reference or "",
                },
                documents,
            )
            question = placed
        out.append(question)
    return out
