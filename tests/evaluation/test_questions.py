"""The question set (JSON lines, every bad line reported), evidence recall/precision (pure), and
placing retrieved nodes in their documents.
"""

from __future__ import annotations

import json

import pytest
from llama_index.core.schema import NodeWithScore, TextNode

from llama_index.packs.self_rag_rse.evaluation import Question, load_questions
from llama_index.packs.self_rag_rse.evaluation.questions import (
    evidence_scores,
    find_span,
    merge_spans,
    questions_from,
    read_documents,
    retrieved_contexts,
)


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
            {
                "question": "When does else run?",
                "document": "loops.txt",
                "evidence": "The else clause\nruns at the end.",
                "reference": "At the end.",
            },
            "",
            {
                "question": "How are names bound?",
                "document": "names.md",
                "evidence": "bound by assignment",
            },
            {"question": "No evidence here?"},
        ],
    )
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


DOC = "Alpha beta gamma.\n\nDelta epsilon zeta. Eta theta.\nIota kappa."


def test_find_span_exact_nearest_and_whitespace_tolerant():
    assert find_span(DOC, "Delta epsilon") == (19, 32)
    text = "ab ab ab"
    assert find_span(text, "ab", near=5) == (6, 8)
    # Re-wrapped evidence (newline where the file has a space, spaces collapsed) is found.
    start, end = find_span(DOC, "zeta.   Eta\ntheta. Iota")
    assert DOC[start:end] == "zeta. Eta theta.\nIota"
    assert find_span(DOC, "omega") is None
    assert find_span(DOC, "   ") is None


def test_merge_spans_joins_overlaps_per_document():
    spans = [("a", 5, 10), ("a", 0, 6), ("b", 0, 3), ("a", 10, 12), ("a", 20, 20)]
    assert merge_spans(spans) == [("a", 0, 12), ("b", 0, 3)]


def test_evidence_scores_known_values():
    gold = ("a", 10, 20)
    # Half the gold span returned, inside 20 returned characters.
    assert evidence_scores(gold, [("a", 0, 15), ("a", 30, 35)]) == (0.5, 0.25)
    # Overlapping chunks count once.
    assert evidence_scores(gold, [("a", 10, 20), ("a", 12, 18)]) == (1.0, 1.0)
    # The right offsets in the wrong document do not count.
    assert evidence_scores(gold, [("b", 10, 20)]) == (0.0, 0.0)
    # Unplaced text counts against precision only; nothing returned: precision undefined.
    assert evidence_scores(gold, [("a", 10, 20)], unplaced_chars=10) == (1.0, 0.5)
    assert evidence_scores(gold, []) == (0.0, None)
    with pytest.raises(ValueError, match="empty"):
        evidence_scores(("a", 5, 5), [])


def node(text, **kwargs):
    metadata = kwargs.pop("metadata", {"file_name": "doc.txt"})
    return NodeWithScore(node=TextNode(text=text, metadata=metadata, **kwargs), score=1.0)


def test_nodes_are_placed_by_offsets_segment_range_or_search():
    documents = {"doc.txt": DOC, "sub/other.txt": "Nothing here."}
    chunk = node("Delta epsilon zeta.", start_char_idx=19, end_char_idx=38)
    wrong_offsets = node("Iota kappa.", start_char_idx=0, end_char_idx=11)
    segment = node(
        "Alpha beta gamma.\n\nDelta",
        metadata={"segment_document_id": "doc.txt", "segment_char_range": [0, 24]},
    )
    by_path = node("Nothing", metadata={"file_path": "/data/docs/sub/other.txt"})
    stranger = node("Not in any document.", metadata={"file_name": "missing.txt"})
    texts, spans, unplaced = retrieved_contexts(
        [chunk, wrong_offsets, segment, by_path, stranger], documents
    )
    assert texts[0] == "Delta epsilon zeta." and len(texts) == 5
    assert spans == [
        ("doc.txt", 19, 38),
        ("doc.txt", DOC.index("Iota"), len(DOC)),
        ("doc.txt", 0, 24),
        ("sub/other.txt", 0, 7),
    ]
    assert unplaced == len("Not in any document.")
    assert retrieved_contexts([chunk]) == (["Delta epsilon zeta."], [], 0)  # no documents


@pytest.mark.parametrize(("encoding", "source"), [("latin-1", "LATIN1"), ("utf-16", "UTF-16")])
def test_a_question_file_not_in_utf8_names_file_line_and_fix(tmp_path, encoding, source):
    qa = tmp_path / "qa.jsonl"
    qa.write_bytes(
        '{"question": "plain?"}\n{"question": "Qu\'est-ce qu\'une clé ?"}\n'.encode(encoding)
    )
    with pytest.raises(ValueError) as info:
        load_questions(qa)
    line = 2 if encoding == "latin-1" else 1  # UTF-16 fails at its byte-order mark
    assert f"--qa: {qa} line {line} is not UTF-8" in str(info.value)
    assert f"iconv -f {source} -t UTF-8 qa.jsonl" in str(info.value)


def test_a_document_not_in_utf8_names_file_line_and_fix(docs):
    (docs / "sub" / "latin.txt").write_bytes("one\ntwo\ncafé\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"--docs: .*latin\.txt line 3 is not UTF-8.*iconv"):
        read_documents(docs)


def test_a_question_file_that_is_a_folder_says_so(tmp_path):
    with pytest.raises(ValueError, match=r"--qa .* is a folder: pass a \.jsonl file"):
        load_questions(tmp_path)


def test_files_saved_on_windows_are_read(docs, tmp_path):
    # NOTES.TXT was left out of the index unsaid; a BOM made the first question line "not JSON".
    (docs / "NOTES.TXT").write_text("Herons wade in shallow water.")
    qa = tmp_path / "qa.jsonl"
    line = {"question": "Where do herons wade?", "document": "NOTES.TXT", "evidence": "Herons"}
    qa.write_bytes(json.dumps(line).encode("utf-8-sig"))
    documents = read_documents(docs)
    assert documents["NOTES.TXT"] == "Herons wade in shallow water."
    assert load_questions(qa, documents)[0].evidence_span == ("NOTES.TXT", 0, 6)


def test_a_document_name_matching_two_files_names_both(tmp_path):
    folder = tmp_path / "docs"
    for name in ("a", "b"):
        (folder / name).mkdir(parents=True)
        (folder / name / "README.md").write_text(f"About {name}.")
    qa = write(tmp_path / "qa.jsonl", [{"question": "q", "document": "README.md"}])
    with pytest.raises(ValueError, match=r"line 1: document 'README\.md'") as info:
        load_questions(qa, read_documents(folder))
    assert "matches 2 files in --docs (a/README.md, b/README.md)" in str(info.value)
    assert "path relative to --docs" in str(info.value) and "not a file" not in str(info.value)


@pytest.mark.parametrize("value", [0, False, [], {}])
def test_a_false_like_field_that_is_no_string_is_refused(docs, tmp_path, value):
    # `item.get(k) or ""` let these pass as empty text: the evidence was dropped without a word.
    for key in ("question", "evidence", "document", "reference"):
        line = {"question": "q", "document": "loops.txt", key: value}
        with pytest.raises(ValueError, match=f'line 1: "{key}" must be a string'):
            load_questions(write(tmp_path / "qa.jsonl", [line]), read_documents(docs))
    # null says "none", like a missing key.
    none = write(tmp_path / "qa.jsonl", [{"question": "q", "evidence": None}])
    (question,) = load_questions(none)
    assert question.evidence is None


def test_a_line_separator_inside_a_question_is_part_of_it(docs, tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028, U+2029 and U+0085 unescaped (valid JSON,
    # common in text from PDFs and web pages); splitting lines on them made such a file
    # "not JSON", with wrong line numbers.
    path = tmp_path / "qa.jsonl"
    lines = [{"question": f"What is{mark}this?"} for mark in ("\u2028", "\u2029", "\x85")]
    path.write_text("\n".join(json.dumps(q, ensure_ascii=False) for q in lines), "utf-8")
    assert [q.question for q in load_questions(path)] == [q["question"] for q in lines]
