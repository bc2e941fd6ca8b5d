"""Reading the question set: the benchmark's JSON-lines format, every bad line reported."""

from __future__ import annotations

import json

import pytest

from llama_index.packs.self_rag_rse.evaluation import Question, load_questions
from llama_index.packs.self_rag_rse.evaluation.questions import questions_from, read_documents


@pytest.fixture
def docs(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "loops.txt").write_text("The while loop repeats.\nThe else clause runs at the end.")
    (folder / "sub" / "names.md").write_text("Names are bound by assignment.")
    (folder / "ignored.bin").write_bytes(b"\x00")
    return folder


def write(path, lines):
    path.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines))
    return path


def test_reads_questions_and_locates_evidence(docs, tmp_path):
    documents = read_documents(docs)
    assert sorted(documents) == ["loops.txt", "sub/names.md"]
    qa = write(
        tmp_path / "qa.jsonl",
        [
            {"question": "When does else run?", "document": "loops.txt",
             "evidence": "The else clause\nruns at the end.", "reference": "At the end."},
            "",
            {"question": "How are names bound?", "document": "names.md",
             "evidence": "bound by assignment"},
            {"question": "No evidence here?"},
        ],
    )  # fmt: skip
    questions = load_questions(qa, documents)
    assert [q.question for q in questions] == [
        "When does else run?",
        "How are names bound?",
        "No evidence here?",
    ]
    first, second, third = questions
    assert first.reference == "At the end." and first.document == "loops.txt"
    doc, start, end = first.evidence_span
    assert documents[doc][start:end] == "The else clause runs at the end."
    assert second.document == "sub/names.md"  # a unique file name finds the file
    assert third.evidence_span is None and third.document is None
    assert load_questions(qa, documents, limit=1) == questions[:1]
    # Without documents, evidence is kept but not located.
    assert load_questions(qa)[0].evidence_span is None


def test_every_bad_line_is_reported_with_its_number(docs, tmp_path):
    qa = write(
        tmp_path / "bad.jsonl",
        [
            "{not json",
            {"document": "loops.txt"},
            {"question": "q", "evidence": "x"},
            {"question": "q", "document": "nope.txt"},
            {"question": "q", "document": "loops.txt", "evidence": "not in the file"},
            {"question": "q", "answer": "typo for reference"},
        ],
    )
    with pytest.raises(ValueError) as info:
        load_questions(qa, read_documents(docs))
    message = str(info.value)
    assert "6 bad line(s)" in message
    lines = {
        int(line.split(":")[0].split()[1]): line
        for line in message.splitlines()
        if line.strip().startswith("line ")
    }
    for number, text in [
        (1, "not JSON"),
        (2, 'no "question"'),
        (3, '"evidence" needs "document"'),
        (4, "not a file in --docs"),
        (5, "copied verbatim"),
        (6, "unknown key(s) ['answer']"),
    ]:
        assert text in lines[number]


def test_missing_inputs_say_what_to_pass(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_questions(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match="not a folder"):
        read_documents(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \.txt or \.md"):
        read_documents(tmp_path / "empty")
    with pytest.raises(ValueError, match="no question"):
        load_questions(write(tmp_path / "blank.jsonl", ["", "  "]))


def test_api_questions_from_strings_and_objects(docs):
    documents = read_documents(docs)
    placed = questions_from(
        ["Plain?", Question("Q?", document="loops.txt", evidence="while loop")], documents
    )
    assert placed[0] == Question("Plain?")
    assert placed[1].evidence_span == ("loops.txt", 4, 14)
    with pytest.raises(ValueError, match="copied verbatim"):
        questions_from([Question("Q?", document="loops.txt", evidence="absent")], documents)
