"""Evidence recall and precision at equal budgets: top-k, RSE, headers + top-k, headers + RSE.

Corpus: the five Python reference chapters shipped in examples/data/python_reference, or any
folder of .txt/.md files (``--docs DIR``). Every method retrieves 30 hits with an offline
embedder (``--embedder``: MiniLM by default, or all-mpnet-base-v2; see embedders.py) from Qdrant
local mode and fills the same character budget (results best first, the last one cut to fit);
recall = evidence characters returned / evidence characters, precision = evidence characters
returned / characters returned: the ``evaluate`` command's evidence scores, on its index builder,
question loader and document reader; IoU = evidence characters returned / characters in the
evidence or returned (Chroma's chunking evaluation's IoU, counted in characters as it does).
Scores count document text only, and the characters each
method returned are reported. "RSE, budget" is given the budget itself (``max_context_chars``),
which also counts the header each segment shows the LLM, so it never needs cutting. "top-k,
whole chunks" is top-k as a prompt packer takes it: best first, a chunk only if it fits whole.

Indexes, each timed (and its LLM calls counted):

- *plain*: SentenceSplitter (128 tokens, overlap 16) + ChunkIndexer given the documents (so
  every chunk's offsets are checked against its document), as docs/rse.md builds it;
- *headers*: DocumentSectioner (headings strategy: sections from the documents' own headings,
  chunked by the same splitter inside each section) + ChunkIndexer + ContextualHeaders (title
  from the document's title heading, else its file name; the section's path of headings),
  embedded as "header\\n\\ntext";
- *doc-title*: the same with headers naming the document only, for the heading queries.

Queries:

- *questions* (``--qa FILE.jsonl``; by default the 40 questions about the shipped chapters in
  benchmarks/data/python_reference_qa.jsonl): the ``self-rag-rse evaluate`` question format, read
  by its loader, each line with ``"document"`` (a file name in DIR) and ``"evidence"`` (text
  copied verbatim from that file). The questions were written about the text, not copied from
  headings, so a header naming the section cannot simply repeat the query;
- *headings*: every section heading (a line underlined with = or -, or a Markdown # heading)
  whose section is at least ``--min-section`` characters; the gold evidence is that section. A
  header holding the section title would repeat such a query (a leak, not a gain), so heading
  queries judge the header methods on the *doc-title* index (document titles, no section
  titles).

A question set may give several gold excerpts per question (``"evidence"`` a list, with
``"evidence_starts"``): Chroma's chunking evaluation, converted by
convert_chunking_evaluation.py (its data is not shipped; that script says how to get it).
``--variants`` adds budgeted RSE rows for other value models in the same run (a calibration
name, ``+best`` or ``+topN`` for ``keep_top_hits``, ``+minX`` for ``minimum_value``, ``+penX``
for ``irrelevant_chunk_penalty``, ``+decayX`` for ``decay_rate``), e.g.
``--variants rank zscore spread+best default+best+min0 default+best+decay15``.

The figures are the same on every run of the same inputs, wherever the documents lie: each
document is known by an id made of its text (not its path), chunk ids are stable
(``ChunkIndexer(stable_ids=True)``) and documents are ingested in the order of those ids, so
Qdrant returns hits of equal score in the same order; and the embedder runs on a fixed number
of torch threads (``--threads``, 1 by default), so its sums run in the same order on every
machine.

``--llm-sections`` adds an index whose sections come from an LLM (the bundled SmolLM2-135M
through LlamaCPP, or ``--llm-model PATH``), results cached under ``--cache-dir`` so a second run
costs no LLM call. The last stdout line is one JSON object: ``{"budgets": [...], "methods":
{"top-k": {"recall": [...], "precision": [...]}, "rse": ..., "headers+top-k": ...,
"headers+rse": ...}, ...}`` from the question set (the heading queries without one; with
both, the heading queries' figures are under ``"heading_queries"``). Where some gold evidence
stands in the corpus more than once (a corpus that holds a document twice), a second table gives
recall counting every verbatim copy of it (``"recall_text"`` in the JSON; otherwise equal to
``"recall"``).

Run: python benchmarks/bench_rse_quality.py [--docs DIR [--qa FILE.jsonl]] [--budgets ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np

from llama_index.packs.self_rag_rse.evaluation.engines import build_index
from llama_index.packs.self_rag_rse.evaluation.questions import (
    load_questions as read_questions,
)
from llama_index.packs.self_rag_rse.evaluation.questions import merge_spans, read_documents

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "examples" / "data" / "python_reference"
SHIPPED_QA = ROOT / "benchmarks" / "data" / "python_reference_qa.jsonl"
HEADING = re.compile(r"\n([^\n]+)\n([=\-]{3,})\n")
ATX_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


@dataclass
class Query:
    """A query and its gold evidence: one or more disjoint spans of one document."""

    text: str
    doc: str
    start: int
    end: int
    more: list[tuple[int, int]] = field(default_factory=list)
    #: Per gold span (in :attr:`gold`'s order), every (document, start) where its exact text
    #: stands in the corpus (filled by :func:`find_copies`; empty: only where it is).
    copies: list[list[tuple[str, int]]] = field(default_factory=list)

    @property
    def gold(self) -> list[tuple[str, int, int]]:
        return merge_spans([(self.doc, self.start, self.end)] + [(self.doc, *s) for s in self.more])


def content_ids(texts: dict[str, str]) -> dict[str, str]:
    """An id for each document (``texts``: path -> text) made of its text, not its path.

    Qdrant returns hits of equal score in the order of their point ids, which stable chunk ids
    derive from the document id; ids from paths made the figures move (by up to 0.002) with the
    folder the documents lie in. Documents with the same text are numbered in path order.
    """
    ids: dict[str, str] = {}
    for key, text in texts.items():
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        copies = sum(other.startswith(digest) for other in ids.values())
        ids[key] = f"{digest}-{copies}"
    return ids


def find_copies(queries: list[Query], texts: dict[str, str]) -> int:
    """Fill each query's :attr:`Query.copies`; return how many gold spans stand verbatim more
    than once (a corpus that holds a filing twice: either copy is the same evidence).
    """
    repeated = 0
    for query in queries:
        query.copies = []
        for doc, start, end in query.gold:
            evidence, found = texts[doc][start:end], []
            for name, text in texts.items():
                at = text.find(evidence)
                while at >= 0:
                    found.append((name, at))
                    at = text.find(evidence, at + 1)
            query.copies.append(found)
            repeated += len(found) > 1
    return repeated


@dataclass
class Index:
    """A built index and what building it cost."""

    name: str
    nodes: list[Any]
    store: Any
    retriever: Any
    advance: float
    prepare_s: float
    embed_s: float
    llm_calls: int = 0
    notes: list[str] = field(default_factory=list)


# -- corpus and queries ---------------------------------------------------------------------------
def load_texts(folder: Path) -> dict[str, str]:
    """Every .txt/.md file under ``folder``, keyed by its path relative to ``folder``."""
    try:
        return read_documents(folder)
    except ValueError as error:
        sys.exit(str(error))


def load_questions(path: Path, texts: dict[str, str]) -> list[Query]:
    """The question set (the ``evaluate`` command's format), each evidence located in its file.

    Stricter than ``evaluate``: a benchmark's evidence must occur exactly once, copied verbatim,
    so that recall measures the passage the question is about. A set whose ``"evidence"`` is a
    list of excerpts (several gold passages per question, as convert_chunking_evaluation.py
    writes) is read by :func:`load_excerpt_questions`.
    """
    try:
        lines = [json.loads(line) for line in path.read_text("utf-8").splitlines() if line.strip()]
    except (OSError, ValueError):
        lines = []  # the loader below names the problem
    if any(isinstance(line, dict) and isinstance(line.get("evidence"), list) for line in lines):
        return load_excerpt_questions(path, lines, texts)
    try:
        questions = read_questions(path, texts)
    except ValueError as error:
        message = str(error).replace("is not a file in --docs", "is not a .txt/.md file")
        sys.exit(f"{path}: {message}")
    queries = []
    for q in questions:
        if q.evidence_span is None or not q.evidence:
            sys.exit(f"{path}: every question needs a document and its evidence: {q.question!r}")
        doc = q.evidence_span[0]
        count = texts[doc].count(q.evidence)
        if count != 1:
            sys.exit(
                f"{path}: the evidence of {q.question!r} occurs {count} times in {doc} (it must "
                f"occur exactly once, copied verbatim): {q.evidence[:80]!r}"
            )
        start = texts[doc].index(q.evidence)
        queries.append(Query(q.question, doc, start, start + len(q.evidence)))
    return queries


def load_excerpt_questions(path: Path, lines: list[dict], texts: dict[str, str]) -> list[Query]:
    """Questions whose gold is several excerpts of one document: ``"evidence"`` a list of
    verbatim excerpts, ``"evidence_starts"`` their offsets (each checked: the excerpt must be
    there; without offsets, each must occur exactly once).
    """
    queries = []
    for number, line in enumerate(lines, start=1):
        doc, excerpts = line.get("document"), line.get("evidence")
        if doc not in texts or not excerpts:
            sys.exit(f"{path} line {number}: needs a document in --docs and its evidence")
        excerpts = [excerpts] if isinstance(excerpts, str) else excerpts
        starts = line.get("evidence_starts") or [None] * len(excerpts)
        spans = []
        for excerpt, start in zip(excerpts, starts, strict=True):
            if start is None:
                if texts[doc].count(excerpt) != 1:
                    sys.exit(f"{path} line {number}: excerpt not found exactly once in {doc}")
                start = texts[doc].index(excerpt)
            if texts[doc][start : start + len(excerpt)] != excerpt:
                sys.exit(f"{path} line {number}: the excerpt is not at {start} in {doc}")
            spans.append((start, start + len(excerpt)))
        merged = [(s, e) for _, s, e in merge_spans([(doc, s, e) for s, e in spans])]
        queries.append(Query(line["question"], doc, *merged[0], more=merged[1:]))
    return queries


def sections(text: str, min_chars: int) -> list[tuple[str, int, int]]:
    """(heading, start, end) of every underlined or # section at least ``min_chars`` long."""
    marks = sorted(
        [(m.start() + 1, m.group(1).strip()) for m in HEADING.finditer(text)]
        + [(m.start(), m.group(1).strip()) for m in ATX_HEADING.finditer(text)]
    )
    found = []
    for i, (start, title) in enumerate(marks):
        end = marks[i + 1][0] if i + 1 < len(marks) else len(text)
        if end - start >= min_chars:
            found.append((title, start, end))
    return found


def heading_queries(texts: dict[str, str], min_chars: int) -> list[Query]:
    return [Query(h, doc, s, e) for doc, t in texts.items() for h, s, e in sections(t, min_chars)]


# -- scoring --------------------------------------------------------------------------------------
def spans_of(items, budget: int) -> list[tuple[str, int, int]]:
    """Character spans of (doc, start, end) results taken best first until the budget is spent."""
    out, used = [], 0
    for doc, start, end in items:
        if used >= budget:
            break
        end = min(end, start + budget - used)
        out.append((doc, start, end))
        used += end - start
    return out


def whole_chunks(items, budget: int) -> list[tuple[str, int, int]]:
    """Top-k as a prompt packer takes it: results best first, each only if it fits whole (a
    longer one is skipped for a shorter one further down); nothing is cut mid-chunk.
    """
    out, used = [], 0
    for doc, start, end in items:
        if used + (end - start) <= budget:
            out.append((doc, start, end))
            used += end - start
    return out


def score(spans, query: Query) -> tuple[float, float, float]:
    """Evidence (recall, precision, IoU) in characters, as ``self-rag-rse evaluate`` measures
    recall and precision (overlaps count once; nothing returned counts as precision 0) and as
    Chroma's chunking evaluation measures IoU: gold characters returned over the characters in
    the gold or returned.
    """
    returned, gold = merge_spans(spans), query.gold
    hit = sum(
        max(0, min(e, ge) - max(s, gs)) for d, s, e in returned for gd, gs, ge in gold if d == gd
    )
    total, wanted = sum(e - s for _, s, e in returned), sum(e - s for _, s, e in gold)
    return hit / wanted, (hit / total if total else 0.0), hit / (total + wanted - hit)


def text_recall(spans, query: Query) -> float:
    """Recall counting the evidence wherever its exact text stands: each gold span scores the
    best of its verbatim copies (:attr:`Query.copies`). Equal to :func:`score`'s recall unless
    the evidence is in the corpus more than once.
    """
    returned, gold = merge_spans(spans), query.gold
    hit = 0
    for (doc, start, end), copies in zip(gold, query.copies or [[]] * len(gold), strict=True):
        hit += max(
            sum(max(0, min(e, at + end - start) - max(s, at)) for d, s, e in returned if d == name)
            for name, at in copies or [(doc, start)]
        )
    return hit / sum(e - s for _, s, e in gold)


# -- indexes --------------------------------------------------------------------------------------
def index_of(name: str, documents, transformations, embed, top_k: int) -> Index:
    """Build the index (timed: preparing, embedding) the ``evaluate`` command's way."""
    built = build_index(documents, embed, transformations, collection=f"bench-{name}")
    llm_calls = sum(getattr(getattr(t, "usage", None), "llm_calls", 0) for t in transformations)
    notes = [n for t in transformations for n in getattr(getattr(t, "usage", None), "rejected", [])]
    total_chars = sum(len(d.text) for d in documents)
    return Index(
        name=name,
        nodes=built.nodes,
        store=built.store,
        retriever=built.index.as_retriever(similarity_top_k=top_k),
        advance=total_chars / max(1, len(built.nodes)),
        prepare_s=built.prepare_s,
        embed_s=built.embed_s,
        llm_calls=llm_calls,
        notes=notes,
    )


def small_llm(model_path: str | None) -> Any:
    """The bundled SmolLM2-135M (or ``model_path``) through LlamaCPP, in its GGUF's template."""
    from llama_index.packs.self_rag_rse.llamacpp.chat_format import load_gguf

    return load_gguf(model_path, max_new_tokens=384, context_window=8192)


# -- methods --------------------------------------------------------------------------------------
def chunk_spans(items):
    return [(n.node.ref_doc_id, n.node.start_char_idx, n.node.end_char_idx) for n in items]


def segment_spans(items):
    return [
        (n.node.metadata["segment_document_id"], *n.node.metadata["segment_char_range"])
        for n in items
        if n.node.metadata.get("segment_char_range") is not None
    ]


def budgeted_rse(index: Index, budgets: list[int], preset: str, extra: dict[str, Any]):
    """RSE given each character budget itself (``max_context_chars``): the search maximises
    value within it, headers counted, and fills what is left with the best remaining hits.
    ``extra`` may set ``calibration`` and ``keep_top_hits`` (a value-model variant).
    """
    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor

    return {
        b: RelevantSegmentPostprocessor(
            vector_store=index.store, preset=preset, max_context_chars=b, **extra
        )
        for b in budgets
    }


#: Variant rules that set a number: ``+minX``, ``+penX``, ``+decayX``.
_NUMERIC = {"min": "minimum_value", "pen": "irrelevant_chunk_penalty", "decay": "decay_rate"}


def _number(rule: str) -> str:
    digits = rule.lstrip("abcdefghijklmnopqrstuvwxyz")
    return digits if digits.replace(".", "", 1).isdigit() else ""


def variant_options(variant: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The RSE options of a value-model variant: ``NAME`` (a calibration; ``default`` keeps the
    default one), then any of ``+best`` (``keep_top_hits=1``), ``+topN`` (``keep_top_hits=N``;
    neither: 0), ``+whole`` (``partial_fill=False``: only whole chunks), ``+bare``
    (``segment_headers=False``: segments without their headers), ``+minX``
    (``minimum_value=X``), ``+penX`` (``irrelevant_chunk_penalty=X``) and ``+decayX``
    (``decay_rate=X``).
    """
    name, *rules = variant.split("+")
    options = {**extra, "keep_top_hits": 0}
    for rule in rules:
        if rule == "best":
            options["keep_top_hits"] = 1
        elif rule.startswith("top") and rule[3:].isdigit():
            options["keep_top_hits"] = int(rule[3:])
        elif rule == "whole":
            options["partial_fill"] = False
        elif rule == "bare":
            options["segment_headers"] = False
        elif (key := _NUMERIC.get(rule.rstrip("0123456789."))) and _number(rule):
            options[key] = float(_number(rule))
        else:
            sys.exit(
                f"variant {variant!r}: use a calibration name, "
                "then +best, +topN, +whole, +bare, +minX, +penX, +decayX"
            )
    if name != "default":
        options["calibration"] = name
    return options


def sized_rse(index: Index, budgets: list[int], preset: str, extra: dict[str, Any]):
    """RSE with its budget knob (overall_max_length, in chunks) sized to each character budget
    from the index's mean chunk advance, so RSE chooses what fits instead of being cut.
    """
    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor

    return {
        b: RelevantSegmentPostprocessor(
            vector_store=index.store,
            preset=preset,
            overall_max_length=max(1, int(b // index.advance)),
            max_length=max(1, min(15, int(b // index.advance))),
            **extra,
        )
        for b in budgets
    }


def evaluate(queries: list[Query], methods: dict[str, tuple[Index, Any]], budgets):
    """Per method and budget, the (recall, precision) of every query, and ms per call."""
    results = {(m, b): [] for m in methods for b in budgets}
    timings = dict.fromkeys(methods, 0.0)
    hits_cache: dict[tuple[str, str], Any] = {}
    for query in queries:
        for name, (index, method) in methods.items():
            key = (index.name, query.text)
            if key not in hits_cache:
                hits_cache[key] = index.retriever.retrieve(query.text)
            for budget in budgets:
                t = time.perf_counter()
                spans = method(hits_cache[key], budget)
                timings[name] += time.perf_counter() - t
                kept = spans_of(spans, budget)
                recall, precision, iou = score(kept, query)
                chars = sum(e - s for _, s, e in kept)
                results[(name, budget)].append(
                    (recall, precision, chars, iou, text_recall(kept, query))
                )
    calls = max(1, len(queries) * len(budgets))
    return results, {m: 1000 * t / calls for m, t in timings.items()}


def table(title: str, methods, results, timings, budgets) -> None:
    print(f"\n{title}")
    print(
        f"{'method':<36}" + "".join(f"| budget {b:>5}: recall  prec   IoU  chars " for b in budgets)
    )
    for name in methods:
        row = f"{name:<36}"
        for budget in budgets:
            r = np.array(results[(name, budget)])
            row += (
                f"| {'':>13}{r[:, 0].mean():6.3f} {r[:, 1].mean():5.3f} {r[:, 3].mean():5.3f} "
                f"{r[:, 2].mean():6.0f} "
            )
        print(row + f"| {timings[name]:.1f} ms/call")


def text_table(methods, results, budgets, queries: list[Query]) -> None:
    """Recall by text (:func:`text_recall`), where some evidence stands in the corpus twice."""
    repeated = sum(len(starts) > 1 for query in queries for starts in query.copies)
    if not repeated:
        return
    spans = sum(len(query.copies) for query in queries)
    print(
        f"recall counting every verbatim copy of the evidence ({repeated} of {spans} gold spans "
        "stand in the corpus more than once: returning either copy returns the same text)"
    )
    for name in methods:
        cells = [np.array(results[(name, b)])[:, 4].mean() for b in budgets]
        print(
            f"{name:<36}"
            + "".join(f"| budget {b:>5}: {c:6.3f} " for b, c in zip(budgets, cells, strict=True))
        )


def paired(results, pairs: dict[str, tuple[str, str]], budgets) -> dict[str, Any]:
    """Question by question, ``ours`` against ``theirs`` (recall by offsets): the mean
    difference, how many questions each returned more of, and a 95% interval of the mean
    difference from 10,000 bootstrap resamples of the questions (seeded: the same every run).
    One question moves a set's mean by 1/n; an interval that holds 0 is a difference the set
    cannot tell from chance.
    """
    out: dict[str, Any] = {}
    for key, (ours, theirs) in pairs.items():
        rows = []
        for budget in budgets:
            diff = (
                np.array(results[(ours, budget)])[:, 0] - np.array(results[(theirs, budget)])[:, 0]
            )
            picks = np.random.default_rng(0).integers(0, diff.shape[0], (10_000, diff.shape[0]))
            low, high = np.percentile(diff[picks].mean(axis=1), [2.5, 97.5])
            rows.append(
                {
                    "mean": round(float(diff.mean()), 4),
                    "more": int((diff > 1e-9).sum()),
                    "less": int((diff < -1e-9).sum()),
                    "interval": [round(float(low), 4), round(float(high), 4)],
                }
            )
        out[key] = rows
    return out


def paired_table(found: dict[str, Any], budgets, count: int) -> None:
    print(
        f"paired against top-k, {count} questions (one question moves a mean by "
        f"{1 / max(1, count):.3f}): recall difference [95% bootstrap interval], questions with "
        "more / less evidence returned"
    )
    for key, rows in found.items():
        cells = [
            f"| budget {b:>5}: {r['mean']:+.3f} [{r['interval'][0]:+.3f}, {r['interval'][1]:+.3f}]"
            f" {r['more']:3d}/{r['less']:<3d}"
            for b, r in zip(budgets, rows, strict=True)
        ]
        print(f"{key:<36}" + " ".join(cells))


def summary(results, names: dict[str, str], budgets) -> dict[str, Any]:
    out = {}
    for key, name in names.items():
        recall = [round(float(np.array(results[(name, b)])[:, 0].mean()), 4) for b in budgets]
        precision = [round(float(np.array(results[(name, b)])[:, 1].mean()), 4) for b in budgets]
        chars = [round(float(np.array(results[(name, b)])[:, 2].mean()), 1) for b in budgets]
        iou = [round(float(np.array(results[(name, b)])[:, 3].mean()), 4) for b in budgets]
        by_text = [round(float(np.array(results[(name, b)])[:, 4].mean()), 4) for b in budgets]
        out[key] = {"recall": recall, "precision": precision, "iou": iou, "chars": chars}
        out[key]["recall_text"] = by_text
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=Path, default=None, help="folder of .txt/.md files")
    parser.add_argument("--qa", type=Path, default=None, help="question set (.jsonl)")
    parser.add_argument("--budgets", type=int, nargs="+", default=[1500, 3000, 6000])
    parser.add_argument("--chunk-size", type=int, default=128, help="tokens per chunk")
    parser.add_argument("--overlap", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=30, help="hits retrieved for every method")
    parser.add_argument(
        "--embedder",
        default="minilm",
        help="'minilm' (default), 'mpnet' (all-mpnet-base-v2 from PyPI, see embedders.py) or a "
        "local sentence-transformers folder",
    )
    parser.add_argument("--min-section", type=int, default=800)
    parser.add_argument("--preset", default="balanced")
    parser.add_argument("--cosine-range", type=float, nargs=2, default=None)
    parser.add_argument(
        "--calibration",
        default=None,
        help="RSE calibration for every RSE method ('raw': cosine as relevance, as dsRAG does "
        "without a reranker); default: the postprocessor's",
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        default=[],
        help="more value models for the budgeted RSE rows, each a calibration name, optionally "
        "with '+best' (keep_top_hits=1) or '+topN' (keep_top_hits=N), and '+whole' "
        "(partial_fill=False) or '+bare' (segment_headers=False), '+minX', '+penX', '+decayX' "
        "(minimum_value, irrelevant_chunk_penalty, decay_rate): e.g. rank zscore spread+best "
        "spread+top2 spread+best+whole default+best+bare default+best+pen0.1",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the embedder: fixed, so that every run (on any machine) sums "
        "in the same order and gives the same vectors",
    )
    parser.add_argument(
        "--no-headings", action="store_true", help="skip the heading queries (and their index)"
    )
    parser.add_argument(
        "--embed-cache",
        type=Path,
        default=None,
        help="folder of chunk vectors kept between runs (by embedder and text): a run with a "
        "full cache skips embedding the chunks and repeats the figures of the run that filled it",
    )
    parser.add_argument(
        "--ablation", action="store_true", help="also sections without headers (which helps?)"
    )
    parser.add_argument(
        "--llm-sections", action="store_true", help="also the LLM sectioning strategy"
    )
    parser.add_argument("--llm-model", default=None, help="GGUF for --llm-sections")
    parser.add_argument("--llm-window-chars", type=int, default=6000)
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=ROOT / "benchmarks" / "out" / "context_cache",
        help="per-document cache of LLM sectionings",
    )
    args = parser.parse_args()

    import torch
    from embedders import cache_embeddings, embedder
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.core.postprocessor import PrevNextNodePostprocessor
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from llama_index.packs.self_rag_rse import ChunkIndexer, RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.context.headers import ContextualHeaders
    from llama_index.packs.self_rag_rse.context.sectioner import DocumentSectioner

    texts = load_texts(args.docs or CORPUS)
    lengths = {k: len(v) for k, v in texts.items()}
    qa_path = args.qa or (SHIPPED_QA if args.docs is None else None)
    questions = load_questions(qa_path, texts) if qa_path else []
    # From here on a document is known by an id made of its text (content_ids), so the same
    # corpus gives the same figures wherever it lies and whatever its files are called.
    ids = content_ids(texts)
    names = {doc_id: key for key, doc_id in ids.items()}
    texts = {ids[key]: texts[key] for key in sorted(texts, key=ids.__getitem__)}
    for question in questions:
        question.doc = ids[question.doc]
    headings = [] if args.no_headings else heading_queries(texts, args.min_section)
    find_copies(questions + headings, texts)
    if not questions and not headings:
        sys.exit("no questions (--qa) and no section headings to use as queries")

    # Identical figures run after run: a fixed thread count fixes the order of the embedder's
    # sums, and stable chunk ids (ChunkIndexer(stable_ids=True)) give Qdrant the same point ids,
    # so hits of equal score come back in the same order.
    torch.set_num_threads(args.threads)
    embed = embedder(args.embedder)
    if args.embed_cache is not None:
        # Keyed by thread count too: another count sums in another order.
        threads = "" if args.threads == 1 else f", {args.threads} threads"
        cache_embeddings(embed, args.embed_cache, args.embedder + threads)

    def splitter():
        return SentenceSplitter(chunk_size=args.chunk_size, chunk_overlap=args.overlap)

    def offline(include_section: bool) -> list[Any]:
        return [
            DocumentSectioner(splitter=splitter()),
            ChunkIndexer(stable_ids=True),
            ContextualHeaders(include_section=include_section),
        ]

    plain_docs = [Document(text=t, id_=k) for k, t in texts.items()]
    # The plain index as docs/rse.md builds it: ChunkIndexer given the documents checks every
    # chunk's offsets against them.
    plain_steps = [splitter(), ChunkIndexer(stable_ids=True, documents=plain_docs)]
    # The file name is for titles only: kept out of the text the splitter sizes and embeds, as
    # SimpleDirectoryReader does.
    named_docs = [
        Document(
            text=t,
            id_=k,
            metadata={"file_name": names[k]},
            excluded_embed_metadata_keys=["file_name"],
            excluded_llm_metadata_keys=["file_name"],
        )
        for k, t in texts.items()
    ]
    plain = index_of("plain", plain_docs, plain_steps, embed, args.top_k)
    indexes = [plain]
    # Questions judge the full headers; heading queries judge headers without section titles,
    # which would repeat the query.
    headed = titled = None
    if questions:
        headed = index_of("headers", named_docs, offline(True), embed, args.top_k)
        indexes.append(headed)
    if headings:
        titled = index_of("doc-title", named_docs, offline(False), embed, args.top_k)
        indexes.append(titled)
    sectioned = llm_index = None
    if args.ablation:
        sections_only = [DocumentSectioner(splitter=splitter()), ChunkIndexer(stable_ids=True)]
        sectioned = index_of("sections", plain_docs, sections_only, embed, args.top_k)
        indexes.append(sectioned)
    if args.llm_sections:
        llm = small_llm(args.llm_model)
        sectioner = DocumentSectioner(
            strategy="llm",
            llm=llm,
            splitter=splitter(),
            window_chars=args.llm_window_chars,
            cache=args.cache_dir,
        )
        llm_index = index_of(
            "llm",
            named_docs,
            [
                sectioner,
                ChunkIndexer(stable_ids=True),
                ContextualHeaders(include_section=bool(questions)),
            ],
            embed,
            args.top_k,
        )
        indexes.append(llm_index)

    print(
        f"embedder: {args.embedder}; "
        f"corpus: {len(texts)} documents, {sum(lengths.values()):,} chars; "
        f"{len(questions)} questions, {len(headings)} heading queries "
        f"(sections >= {args.min_section} chars); top-{args.top_k} hits per query"
    )
    print("\ningestion (before embedding / embedding; LLM calls):")
    for index in indexes:
        print(
            f"  {index.name:<9} {len(index.nodes):5d} chunks  {index.prepare_s:6.1f} s / "
            f"{index.embed_s:5.1f} s  LLM calls {index.llm_calls}"
            + (f"  rejected windows {len(index.notes)}" if index.notes else "")
        )
    if llm_index is not None and llm_index.notes:
        print(f"  first rejection: {llm_index.notes[0][:300]}")

    extra: dict[str, Any] = {"cosine_range": tuple(args.cosine_range)} if args.cosine_range else {}
    if args.calibration:
        extra["calibration"] = args.calibration
    docstore = SimpleDocumentStore()  # PrevNext needs one; RSE reads from Qdrant only
    docstore.add_documents(plain.nodes)
    prevnext = PrevNextNodePostprocessor(docstore=docstore, num_nodes=1, mode="both")
    rse = RelevantSegmentPostprocessor(vector_store=plain.store, preset=args.preset, **extra)
    sized = {index.name: sized_rse(index, args.budgets, args.preset, extra) for index in indexes}
    budgeted = {
        index.name: budgeted_rse(index, args.budgets, args.preset, extra) for index in indexes
    }
    variants = {v: variant_options(v, extra) for v in args.variants}
    variant_rse = {
        (v, index.name): budgeted_rse(index, args.budgets, args.preset, options)
        for v, options in variants.items()
        for index in indexes
    }

    def topk_method(index: Index):
        return index, lambda hits, budget: chunk_spans(hits)

    def whole_method(index: Index):
        return index, lambda hits, budget: whole_chunks(chunk_spans(hits), budget)

    def rse_method(index: Index):
        return index, lambda hits, budget: segment_spans(
            budgeted[index.name][budget].postprocess_nodes(hits)
        )

    def variant_method(index: Index, variant: str):
        return index, lambda hits, budget: segment_spans(
            variant_rse[(variant, index.name)][budget].postprocess_nodes(hits)
        )

    def sized_method(index: Index):
        return index, lambda hits, budget: segment_spans(
            sized[index.name][budget].postprocess_nodes(hits)
        )

    rse_name = "RSE, budget"
    no_headers = {
        "top-k": topk_method(plain),
        "PrevNext(1, both)": (plain, lambda h, b: chunk_spans(prevnext.postprocess_nodes(h))),
        f"RSE {args.preset}": (plain, lambda h, b: segment_spans(rse.postprocess_nodes(h))),
        f"RSE {args.preset}, sized": sized_method(plain),
        rse_name: rse_method(plain),
    }
    extras: dict[str, tuple[Index, Any]] = {}
    if sectioned is not None:
        extras["sections only + top-k"] = topk_method(sectioned)
        extras["sections only + RSE, budget"] = rse_method(sectioned)
    llm_rows: dict[str, tuple[Index, Any]] = {}
    if llm_index is not None:  # judged by the questions (its headers hold section titles)
        llm_rows["LLM sections + top-k"] = topk_method(llm_index)
        llm_rows["LLM sections + RSE, budget"] = rse_method(llm_index)
    final: dict[str, Any] = {"budgets": args.budgets, "embedder": args.embedder}

    def run(kind: str, queries: list[Query], index: Index, note: str) -> dict[str, Any]:
        baseline = no_headers if kind == "heading queries" else {
            name: no_headers[name] for name in ("top-k", rse_name)
        }  # fmt: skip
        methods = {
            **baseline,
            "top-k, whole chunks": whole_method(plain),
            "headers + top-k": topk_method(index),
            "headers + top-k, whole": whole_method(index),
            "headers + RSE, budget": rse_method(index),
            **{f"RSE, budget [{v}]": variant_method(plain, v) for v in variants},
            **{f"headers + RSE, budget [{v}]": variant_method(index, v) for v in variants},
            **extras,
            **(llm_rows if kind == "questions" or not questions else {}),
        }
        results, timings = evaluate(queries, methods, args.budgets)
        table(f"{kind} ({len(queries)}; {note})", methods, results, timings, args.budgets)
        text_table(methods, results, args.budgets, queries)
        names = {
            "top-k": "top-k",
            "rse": rse_name,
            "headers+top-k": "headers + top-k",
            "headers+rse": "headers + RSE, budget",
            "top-k-whole": "top-k, whole chunks",
            "headers+top-k-whole": "headers + top-k, whole",
        }
        found = summary(results, names, args.budgets)
        found["paired"] = paired(
            results,
            {
                "RSE - top-k": (rse_name, "top-k"),
                "headers + RSE - headers + top-k": ("headers + RSE, budget", "headers + top-k"),
            },
            args.budgets,
        )
        paired_table(found["paired"], args.budgets, len(queries))
        ours, theirs = found["headers+rse"]["recall"], found["rse"]["recall"]
        shown = [
            f"{b} chars {h:.3f} vs {r:.3f}"
            for b, h, r in zip(args.budgets, ours, theirs, strict=True)
        ]
        better = all(h > r for h, r in zip(ours, theirs, strict=True))
        verdict = "better at every budget" if better else "NOT better at every budget"
        print(f"headers + RSE vs RSE recall, {kind}: " + ", ".join(shown) + f": {verdict}")
        if variants:
            found["variants"] = {
                v: summary(
                    results,
                    {"rse": f"RSE, budget [{v}]", "headers+rse": f"headers + RSE, budget [{v}]"},
                    args.budgets,
                )
                for v in variants
            }
        if "LLM sections + top-k" in methods:
            found["llm_sections"] = summary(
                results,
                {"top-k": "LLM sections + top-k", "rse": "LLM sections + RSE, budget"},
                args.budgets,
            )
        return found

    if questions and headed is not None:
        final["methods"] = run(
            "questions", questions, headed, "evidence copied from the text; full headers"
        )
        final["queries"] = {"kind": "questions", "count": len(questions)}
    if headings and titled is not None:
        found = run(
            "heading queries",
            headings,
            titled,
            "gold = the section; headers hold document titles only (a section title would "
            "repeat the query)",
        )
        if not questions:
            final["methods"] = found
            final["queries"] = {"kind": "headings", "count": len(headings)}
        else:
            final["heading_queries"] = found
    final["ingestion"] = {
        index.name: {
            "chunks": len(index.nodes),
            "prepare_s": round(index.prepare_s, 2),
            "embed_s": round(index.embed_s, 2),
            "llm_calls": index.llm_calls,
            **({"rejected_windows": len(index.notes)} if index.name == "llm" else {}),
        }
        for index in indexes
    }
    print(json.dumps(final))


if __name__ == "__main__":
    sys.exit(main())
