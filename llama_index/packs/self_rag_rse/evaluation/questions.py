"""The question set, where its gold evidence lies, and how much of it an engine retrieved:
evidence recall and precision in characters, no model needed (as the retrieval benchmark
measures); overlaps count once, and returned text placed nowhere counts against precision.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from llama_index.core.schema import MetadataMode, NodeWithScore

#: ``(document name, start, end)``, end exclusive.
Span = tuple[str, int, int]
_KEYS = {"question", "document", "evidence", "reference"}
#: Node metadata keys that may name a node's document, tried in order (then ``ref_doc_id``).
DOCUMENT_KEYS = ("segment_document_id", "file_path", "file_name")
TEXT_SUFFIXES = (".txt", ".md")


@dataclass(frozen=True)
class Question:
    """One question of the set; ``evidence_span`` is where ``evidence`` lies in ``document``
    (set when the documents are given: evidence recall/precision need it).
    """

    question: str
    document: str | None = None
    evidence: str | None = None
    reference: str | None = None
    evidence_span: Span | None = None


def read_documents(folder: str | Path) -> dict[str, str]:
    """The ``.txt``/``.md`` files (any case) under ``folder`` (UTF-8), keyed by relative path."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"--docs {root} is not a folder: pass a folder of .txt or .md files")
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise ValueError(f"no .txt or .md files under {root}: pass --docs with some text files")
    return {p.relative_to(root).as_posix(): read_utf8(p, "--docs") for p in files}


def read_utf8(path: Path, flag: str) -> str:
    """``path``'s text (BOM dropped); another encoding: ``ValueError`` naming file, line, fix."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        source = "UTF-16" if data[:2] in (b"\xff\xfe", b"\xfe\xff") else "LATIN1"
        raise ValueError(
            f"{flag}: {path} line {line} is not UTF-8 ({error.reason}): convert the file, "
            f"e.g. iconv -f {source} -t UTF-8 {path.name} > utf8-{path.name}"
        ) from None


def resolve_document(name: str, documents: Mapping[str, str]) -> str | None:
    """The key of ``documents`` that ``name`` designates: itself, a unique file name match, or
    the key an absolute path (SimpleDirectoryReader's ``file_path``) ends with.
    """
    if name in documents:
        return name
    matches = [key for key in documents if Path(key).name == Path(name).name]
    if len(matches) == 1:
        return matches[0]
    # An absolute path ends with the relative key it designates.
    return next((key for key in documents if Path(name).as_posix().endswith("/" + key)), None)


def load_questions(
    path: str | Path, documents: Mapping[str, str] | None = None, limit: int | None = None
) -> list[Question]:
    """Read a JSON-lines question set, locating each ``evidence`` in ``documents``; a
    ``ValueError`` lists every bad line. ``limit`` keeps the first questions only.
    """
    source = Path(path)
    if not source.is_file():
        what = "is a folder" if source.is_dir() else "does not exist"
        raise ValueError(f"--qa {source} {what}: pass a .jsonl file of questions")
    questions: list[Question] = []
    problems: list[str] = []
    for number, line in enumerate(read_utf8(source, "--qa").split("\n"), start=1):  # not U+2028
        try:
            if line.strip():
                questions.append(_parse(json.loads(line), documents))
        except json.JSONDecodeError as error:
            problems.append(f"line {number}: not JSON ({error.msg})")
        except ValueError as error:
            problems.append(f"line {number}: {error}")
    if problems:
        more = [f"... and {len(problems) - 20} more"] if len(problems) > 20 else []
        shown = "\n  ".join(problems[:20] + more)
        raise ValueError(f"{source} has {len(problems)} bad line(s):\n  {shown}")
    if not questions:
        raise ValueError(f"{source} holds no question: one JSON object per line")
    return questions[:limit]


def questions_from(
    items: Iterable[str | Question], documents: Mapping[str, str] | None = None
) -> list[Question]:
    """``Question`` objects from strings or questions; with ``documents``, each ``evidence``
    without an ``evidence_span`` is located (``ValueError`` when it is not found).
    """
    out = []
    for item in items:
        question = item if isinstance(item, Question) else Question(str(item))
        if documents is not None and question.evidence and question.evidence_span is None:
            # Located as a line of the set is (evidence_span is no key of a line).
            question = _parse(
                {key: value for key, value in asdict(question).items() if key in _KEYS}, documents
            )
        out.append(question)
    return out


def _parse(item: object, documents: Mapping[str, str] | None) -> Question:
    """One line of the set; ``ValueError`` says what is wrong with it."""
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    if unknown := sorted(set(item) - _KEYS):
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")
    if wrong := [k for k in sorted(_KEYS) if not isinstance(item.get(k), (str, type(None)))]:
        raise ValueError(f'"{wrong[0]}" must be a string')
    if not (item.get("question") or "").strip():
        raise ValueError('no "question" (a non-empty string)')
    document = item.get("document") or None
    evidence = item.get("evidence") or None
    span = None
    if evidence and not document:
        raise ValueError('"evidence" needs "document" (the file it is copied from)')
    if documents is not None and document:
        if (name := resolve_document(document, documents)) is None:
            if same := [key for key in documents if Path(key).name == Path(document).name]:
                raise ValueError(
                    f"document {document!r} matches {len(same)} files in --docs "
                    f"({', '.join(same)}): give its path relative to --docs, e.g. {same[0]!r}"
                )
            raise ValueError(
                f"document {document!r} is not a file in --docs: give a path relative to "
                "--docs, or the file name of one file there"
            )
        if evidence:
            found = find_span(documents[name], evidence)
            if found is None:
                raise ValueError(
                    f"the evidence is not in {name}: it must be copied verbatim from the file "
                    "(only runs of whitespace may differ)"
                )
            span = (name, *found)
        document = name
    return Question(
        question=item["question"].strip(),
        document=document,
        evidence=evidence,
        reference=item.get("reference") or None,
        evidence_span=span,
    )


def find_span(text: str, fragment: str, near: int | None = None) -> tuple[int, int] | None:
    """Where ``fragment`` occurs in ``text``, ``(start, end)`` or ``None``: exactly (the one
    starting closest to ``near``), else with runs of whitespace matched loosely (re-wrapped).
    """
    exact = re.finditer(f"(?={re.escape(fragment)})", text)  # every start, overlapping ones too
    loose = re.finditer(r"\s+".join(map(re.escape, fragment.split())), text)
    spans = [(m.start(), m.start() + len(fragment)) for m in exact] or [m.span() for m in loose]
    if not spans or not fragment.split():
        return None
    return spans[0] if near is None else min(spans, key=lambda span: abs(span[0] - near))


def merge_spans(spans: Iterable[Span]) -> list[Span]:
    """The union of ``spans`` as sorted, disjoint spans (touching spans are joined)."""
    merged: list[Span] = []
    for doc, start, end in sorted(s for s in spans if s[2] > s[1]):
        if merged and merged[-1][0] == doc and start <= merged[-1][2]:
            merged[-1] = (doc, merged[-1][1], max(merged[-1][2], end))
        else:
            merged.append((doc, start, end))
    return merged


def evidence_scores(
    gold: Span, returned: Sequence[Span], unplaced_chars: int = 0
) -> tuple[float, float | None]:
    """``(recall, precision)`` of the returned text against the gold span (precision ``None``
    when nothing was returned); ``unplaced_chars``, placed nowhere, count against precision.
    """
    gold_doc, gold_start, gold_end = gold
    if gold_end <= gold_start:
        raise ValueError(f"the gold span {gold} is empty")
    union = merge_spans(returned)
    hit = sum(max(0, min(e, gold_end) - max(s, gold_start)) for d, s, e in union if d == gold_doc)
    total = sum(end - start for _, start, end in union) + max(0, unplaced_chars)
    return hit / (gold_end - gold_start), (hit / total if total else None)


def retrieved_contexts(
    source_nodes: Sequence[NodeWithScore], documents: Mapping[str, str] | None = None
) -> tuple[list[str], list[Span], int]:
    """The texts of ``source_nodes`` and, with ``documents``, their spans and unplaced chars."""
    read = [(n.node, n.node.get_content(metadata_mode=MetadataMode.NONE)) for n in source_nodes]
    kept = [(node, text) for node, text in read if text.strip()]
    texts = [text for _, text in kept]
    if not documents:
        return texts, [], 0
    placed = [(text, place_node(node, text, documents)) for node, text in kept]
    spans = [span for _, span in placed if span is not None]
    unplaced = sum(len(text) for text, span in placed if span is None)
    return texts, spans, unplaced


def place_node(node: Any, text: str, documents: Mapping[str, str]) -> Span | None:
    """``(document, start, end)`` of ``node`` in ``documents``, or ``None``."""
    meta = node.metadata or {}
    candidates = [*(meta.get(key) for key in DOCUMENT_KEYS), getattr(node, "ref_doc_id", None)]
    resolved = (resolve_document(str(c), documents) for c in candidates if c)
    name = next((found for found in resolved if found), None)
    if name is None:
        return None
    offsets = (getattr(node, "start_char_idx", None), getattr(node, "end_char_idx", None))
    ranges: list[Any] = [meta.get("segment_char_range"), offsets]
    pairs = [r for r in ranges if isinstance(r, (list, tuple)) and len(r) == 2 and None not in r]
    doc = documents[name]
    hints = [(int(start), int(end)) for start, end in pairs]
    valid = [(start, end) for start, end in hints if 0 <= start < end <= len(doc)]
    for start, end in valid:
        # Offsets are trusted when the text there is the node's, whitespace aside (RSE restores it).
        if doc[start:end].split() == text.split():
            return name, start, end
    found = find_span(doc, text, near=hints[0][0] if hints else None)
    if found is None and hints and hints[0] in valid:
        found = hints[0]
    return (name, *found) if found is not None else None
