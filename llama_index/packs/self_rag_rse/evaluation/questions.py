"""The question set, where its gold evidence lies, and how much of it an engine retrieved.

A ``--qa`` line is a JSON object with ``question`` and, optionally, ``document`` (a file in
``--docs``), ``evidence`` (text copied verbatim from it) and ``reference`` (a reference answer);
every bad line is reported at once, before any model loads. Evidence recall is gold characters
returned / gold characters, precision gold characters returned / characters returned, with no
model involved (the retrieval benchmark measures the same way). Returned nodes are placed in
their documents by RSE's ``segment_char_range``, by ``start_char_idx``/``end_char_idx`` when the
text there matches, or by a search; overlaps count once (as in a prompt), and text that cannot
be placed counts against precision.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from llama_index.core.schema import MetadataMode, NodeWithScore

#: ``(document name, start, end)``, end exclusive.
Span = tuple[str, int, int]
_KEYS = {"question", "document", "evidence", "reference"}
#: Node metadata keys that may name a node's document, tried in order (then ``ref_doc_id``).
DOCUMENT_KEYS = ("segment_document_id", "file_path", "file_name")


@dataclass(frozen=True)
class Question:
    """One question of the set; ``evidence_span`` is where ``evidence`` lies in ``document``
    (set when the documents are given: evidence recall/precision need it)."""

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
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in (".txt", ".md"))
    if not files:
        raise ValueError(f"no .txt or .md files under {root}: pass --docs with some text files")
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in files}


def resolve_document(name: str, documents: Mapping[str, str]) -> str | None:
    """The key of ``documents`` that ``name`` designates: itself, or a unique file name match."""
    if name in documents:
        return name
    matches = [key for key in documents if Path(key).name == Path(name).name]
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
        try:
            if line.strip():
                questions.append(_parse(json.loads(line), documents))
        except json.JSONDecodeError as error:
            problems.append(f"line {number}: not JSON ({error.msg})")
        except ValueError as error:
            problems.append(f"line {number}: {error}")
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ValueError(f"{source} has {len(problems)} bad line(s):\n  {shown}{more}")
    if not questions:
        raise ValueError(f"{source} holds no question: one JSON object per line")
    return questions[:limit] if limit is not None else questions


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
            try:
                question = _parse({k: v for k, v in asdict(question).items() if v}, documents)
            except ValueError as error:
                raise ValueError(f"question {question.question!r}: {error}") from error
        out.append(question)
    return out


def _parse(item: object, documents: Mapping[str, str] | None) -> Question:
    """One line of the set; ``ValueError`` says what is wrong with it."""
    if not isinstance(item, dict):
        raise ValueError("each line must be a JSON object")
    if not isinstance(item.get("question"), str) or not item["question"].strip():
        raise ValueError('no "question" (a non-empty string)')
    if unknown := sorted(set(item) - _KEYS):
        raise ValueError(f"unknown key(s) {unknown}; allowed: {sorted(_KEYS)}")
    for key in ("document", "evidence", "reference"):
        if item.get(key) is not None and not isinstance(item[key], str):
            raise ValueError(f'"{key}" must be a string')
    document, evidence, span = item.get("document") or None, item.get("evidence") or None, None
    if evidence and not document:
        raise ValueError('"evidence" needs "document" (the file it is copied from)')
    if documents is not None and document:
        if (name := resolve_document(document, documents)) is None:
            raise ValueError(f"document {document!r} is not a file in --docs")
        found = find_span(documents[name], evidence) if evidence else None
        if evidence and found is None:
            raise ValueError(
                f"the evidence is not in {name} (it must be copied verbatim from the file)"
            )
        document, span = name, ((name, *found) if found else None)
    reference = item.get("reference") or None
    return Question(item["question"].strip(), document, evidence, reference, span)


def find_span(text: str, fragment: str, near: int | None = None) -> tuple[int, int] | None:
    """Where ``fragment`` occurs in ``text``: ``(start, end)``, or ``None``.

    An exact occurrence wins (the one starting closest to ``near``, when given); otherwise runs of
    whitespace match loosely, so a passage re-wrapped or with its blank lines collapsed is still
    found. Empty fragments are never found.
    """
    words = fragment.split()
    if not words:
        return None
    exact = re.finditer(f"(?={re.escape(fragment)})", text)  # every start, overlapping ones too
    spans = [(m.start(), m.start() + len(fragment)) for m in exact] or [
        m.span() for m in re.finditer(r"\s+".join(map(re.escape, words)), text)
    ]
    if not spans:
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
    """``(recall, precision)`` of the returned text against the gold span.

    ``unplaced_chars`` is returned text that could not be placed in any document (it counts
    against precision, never for recall). Precision is ``None`` when nothing was returned.
    """
    gold_doc, gold_start, gold_end = gold
    if gold_end <= gold_start:
        raise ValueError(f"the gold span {gold} is empty")
    union = merge_spans(returned)
    hit = sum(
        max(0, min(end, gold_end) - max(start, gold_start))
        for doc, start, end in union
        if doc == gold_doc
    )
    total = sum(end - start for _, start, end in union) + max(0, unplaced_chars)
    return hit / (gold_end - gold_start), (hit / total if total else None)


class Retrieved(NamedTuple):
    """The context texts of one response, their spans in the documents, the unplaced rest."""

    texts: list[str]
    spans: list[Span]
    unplaced_chars: int


def retrieved_contexts(
    source_nodes: Sequence[NodeWithScore], documents: Mapping[str, str] | None = None
) -> Retrieved:
    """The texts of ``source_nodes`` (in order) and, with ``documents``, their spans."""
    texts = [(n.node, n.node.get_content(metadata_mode=MetadataMode.NONE)) for n in source_nodes]
    kept = [(node, text) for node, text in texts if text.strip()]
    if documents is None:
        return Retrieved([text for _, text in kept], [], 0)
    spans = [place_node(node, text, documents) for node, text in kept]
    unplaced = sum(len(text) for (_, text), span in zip(kept, spans, strict=True) if span is None)
    return Retrieved([text for _, text in kept], [s for s in spans if s is not None], unplaced)


def place_node(node: Any, text: str, documents: Mapping[str, str]) -> Span | None:
    """``(document, start, end)`` of ``node`` in ``documents``, or ``None``."""
    meta = node.metadata or {}
    for candidate in [*(meta.get(key) for key in DOCUMENT_KEYS), getattr(node, "ref_doc_id", None)]:
        if not candidate:
            continue
        # An absolute path (SimpleDirectoryReader's file_path) ends with the document's key.
        path = Path(str(candidate)).as_posix()
        name = resolve_document(str(candidate), documents) or next(
            (key for key in documents if path.endswith("/" + key)), None
        )
        if name is not None:
            break
    else:
        return None
    doc, hints = documents[name], []
    if isinstance(meta.get("segment_char_range"), (list, tuple)):
        hints.append((int(meta["segment_char_range"][0]), int(meta["segment_char_range"][1])))
    start, end = getattr(node, "start_char_idx", None), getattr(node, "end_char_idx", None)
    if start is not None and end is not None:
        hints.append((int(start), int(end)))
    valid = [(a, b) for a, b in hints if 0 <= a < b <= len(doc)]
    for a, b in valid:
        # Offsets are trusted when the text there is the node's, whitespace aside (RSE puts
        # back whitespace a splitter stripped, not necessarily the same characters).
        if doc[a:b].split() == text.split():
            return name, a, b
    found = find_span(doc, text, near=hints[0][0] if hints else None)
    if found is None and hints and hints[0] in valid:
        found = hints[0]
    return (name, *found) if found is not None else None
