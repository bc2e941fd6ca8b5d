"""Convert Chroma's chunking evaluation set into the retrieval benchmark's inputs.

Chroma's general evaluation (github.com/brandonstarxel/chunking_evaluation) holds 472 questions
over five corpora, each question with one or more gold excerpts given by character offsets. Its
data licence is not stated, so the project does not ship it: clone that repository and point
this script at it::

    git clone https://github.com/brandonstarxel/chunking_evaluation
    python benchmarks/convert_chunking_evaluation.py chunking_evaluation OUT
    python benchmarks/bench_rse_quality.py --docs OUT/docs --qa OUT/questions.jsonl

``OUT/docs`` gets the five corpora (``chatlogs.md``, ``finance.md``, ...) exactly as Chroma's
evaluation reads them (UTF-8, universal newlines, so the offsets hold), ``OUT/questions.jsonl``
one line per question: ``{"question", "document", "evidence": [excerpt, ...],
"evidence_starts": [offset, ...]}``, the excerpts in the order given. Every excerpt is checked to
be verbatim at its offsets; one that is not is reported and located by its text instead (the
nearest occurrence to the given offset), or dropped when its text is nowhere in the corpus.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

DATA = Path("chunking_evaluation") / "evaluation_framework" / "general_evaluation_data"


def read_corpus(path: Path) -> str:
    """The corpus as Chroma's evaluation reads it: ``open(path, encoding="utf-8").read()``."""
    with path.open(encoding="utf-8") as handle:
        return handle.read()


def nearest(text: str, excerpt: str, start: int) -> int | None:
    """The occurrence of ``excerpt`` in ``text`` closest to ``start``, or ``None``."""
    found, at = [], text.find(excerpt)
    while at >= 0:
        found.append(at)
        at = text.find(excerpt, at + 1)
    return min(found, key=lambda s: abs(s - start)) if found else None


def convert(source: Path, out: Path) -> dict[str, int]:
    """Write ``out/docs`` and ``out/questions.jsonl`` from the clone at ``source``; returns
    counts (questions, excerpts, excerpts moved, excerpts dropped, questions dropped).
    """
    data = source / DATA if (source / DATA).is_dir() else source
    questions_csv, corpora = data / "questions_df.csv", data / "corpora"
    if not questions_csv.is_file() or not corpora.is_dir():
        sys.exit(
            f"{source}: no {DATA}/questions_df.csv and corpora/ here: pass the folder of a "
            "clone of github.com/brandonstarxel/chunking_evaluation"
        )
    texts = {p.stem: read_corpus(p) for p in sorted(corpora.glob("*.md"))}
    (out / "docs").mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        # newline="" keeps the text byte for byte as read, so the offsets hold on reading back.
        with (out / "docs" / f"{name}.md").open("w", encoding="utf-8", newline="") as handle:
            handle.write(text)
    counts = dict.fromkeys(("questions", "excerpts", "moved", "dropped", "questions dropped"), 0)
    lines = []
    with questions_csv.open(encoding="utf-8", newline="") as handle:
        for number, row in enumerate(csv.DictReader(handle), start=2):
            corpus, text = row["corpus_id"], texts.get(row["corpus_id"])
            if text is None:
                sys.exit(f"{questions_csv} line {number}: no corpus {corpus!r} in {corpora}")
            evidence, starts = [], []
            for ref in json.loads(row["references"]):
                content, start = ref["content"], int(ref["start_index"])
                counts["excerpts"] += 1
                if text[start : int(ref["end_index"])] != content:
                    moved = nearest(text, content, start)
                    where = "dropped" if moved is None else f"found at {moved}"
                    print(
                        f"line {number} ({corpus}): excerpt not verbatim at {start}; {where}: "
                        f"{content[:60]!r}",
                        file=sys.stderr,
                    )
                    counts["moved" if moved is not None else "dropped"] += 1
                    if moved is None:
                        continue
                    start = moved
                evidence.append(content)
                starts.append(start)
            if not evidence:
                counts["questions dropped"] += 1
                continue
            counts["questions"] += 1
            lines.append(
                json.dumps(
                    {
                        "question": row["question"],
                        "document": f"{corpus}.md",
                        "evidence": evidence,
                        "evidence_starts": starts,
                    },
                    ensure_ascii=False,
                )
            )
    (out / "questions.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a clone of brandonstarxel/chunking_evaluation")
    parser.add_argument("out", type=Path, help="folder to write docs/ and questions.jsonl into")
    args = parser.parse_args()
    counts = convert(args.source, args.out)
    print(
        f"{counts['questions']} questions, {counts['excerpts']} excerpts ({counts['moved']} not "
        f"at their offsets and found elsewhere, {counts['dropped']} not found, "
        f"{counts['questions dropped']} questions left without one) -> {args.out}"
    )


if __name__ == "__main__":
    main()
