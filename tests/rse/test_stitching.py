"""Stitching chunks back into document text: real splitter output, then offsets that lie."""

from __future__ import annotations

import pytest

from llama_index.packs.self_rag_rse.rse.stitching import (
    MAX_LINKED_GAP,
    MAX_STRIPPED_GAP,
    MIN_TEXT_OVERLAP,
    find_breaks,
    stitch_chunks,
    suspect_offsets,
)


def parts(nodes):
    texts = [n.get_content() for n in nodes]
    spans = [(n.start_char_idx, n.end_char_idx) for n in nodes]
    return texts, spans


@pytest.mark.parametrize(("chunk_size", "overlap"), [(64, 0), (96, 24), (128, 16)])
def test_real_splitter_output_stitches_to_the_source_span(
    split, source_text, whitespace_equal, chunk_size, overlap
):
    nodes = split(chunk_size, overlap)
    texts, spans = parts(nodes)
    (piece,) = stitch_chunks(texts, spans, [True] * len(nodes))
    source = source_text("execmodel")
    assert (piece.start_char, piece.end_char) == (spans[0][0], spans[-1][1])
    assert whitespace_equal(piece.text, source[piece.start_char : piece.end_char])
    assert (piece.first, piece.stop) == (0, len(nodes))
    if overlap == 0:
        assert piece.gaps > 0  # stripped whitespace between chunks, refilled to its width


def test_overlap_cut_is_checked_against_the_text():
    # Offsets claim "abcdefgh" overlaps by 4, but the next chunk does not start with "efgh".
    texts = ["0123456789abcdefgh", "WXYZ and then the rest of the next chunk"]
    spans = [(0, 18), (14, 14 + len(texts[1]))]
    assert suspect_offsets(texts, spans) == [True, True]
    pieces = stitch_chunks(texts, spans, [False, True])
    # Linked neighbours whose offsets cannot be trusted: joined with one newline, no range.
    assert [p.text for p in pieces] == [
        "0123456789abcdefgh\nWXYZ and then the rest of the next chunk"
    ]
    assert (pieces[0].start_char, pieces[0].end_char) == (None, None)
    # Not linked: nothing says they are neighbours, so they stay apart.
    unlinked = stitch_chunks(texts, spans)
    assert [p.text for p in unlinked] == texts
    assert all(p.start_char is None for p in unlinked)
    assert "overlap" in find_breaks(texts, spans)[0].reason


def test_wrong_offsets_fall_back_to_text_matching():
    source = "The quick brown fox jumps over the lazy dog, and then it runs far away."
    left, right = source[:40], source[24:]  # a true overlap of 16 characters
    for shift in (-10, 10):  # length-consistent offsets that claim a wrong overlap
        wrong = (24 + shift, len(source) + shift)
        (piece,) = stitch_chunks([left, right], [(0, 40), wrong])
        assert piece.text == source
        assert (piece.start_char, piece.end_char) == (None, None)  # cannot vouch for it


def test_text_repeated_across_a_stripped_gap_is_kept(source_text, whitespace_equal):
    from corpus import corpus_documents
    from llama_index.core.node_parser import TokenTextSplitter

    # On the shipped corpus this splitter cuts "... | double_star_pattern" from
    # "double_star_pattern ::= ...": the same 19 characters on both sides of a stripped gap.
    splitter = TokenTextSplitter(chunk_size=64, chunk_overlap=0)
    nodes = splitter.get_nodes_from_documents(corpus_documents(("compound",)))
    texts, spans = parts(nodes)
    (piece,) = stitch_chunks(texts, spans, [True] * len(nodes))
    source = source_text("compound")
    assert whitespace_equal(piece.text, source[piece.start_char : piece.end_char])


def test_a_gap_wider_than_a_splitter_strips_is_a_hole():
    source = "first chunk text." + " " * 2 + "A sentence nobody kept." + "\n" + "last chunk text."
    a, b = source[:17], source[-16:]
    spans = [(0, 17), (len(source) - 16, len(source))]
    pieces = stitch_chunks([a, b], spans)
    assert [p.text for p in pieces] == [a, b]
    assert [(p.start_char, p.end_char) for p in pieces] == [spans[0], spans[1]]
    assert [(p.first, p.stop) for p in pieces] == [(0, 1), (1, 2)]
    (hole,) = find_breaks([a, b], spans)
    assert hole.index == 1 and "gap" in hole.reason


def test_gap_width_limits():
    # Texts that do not repeat themselves: "x" * 20 could sit anywhere in a run of x's, so a gap
    # after it is no evidence (see test_repeated_text_is_joined_whole_never_refilled).
    a, b = "first chunk of text.", "Then the next chunk."

    def joined(gap: int, linked: bool) -> bool:
        spans = [(0, 20), (20 + gap, 40 + gap)]
        return len(stitch_chunks([a, b], spans, [False, linked])) == 1

    assert joined(MAX_STRIPPED_GAP, linked=False)
    assert not joined(MAX_STRIPPED_GAP + 1, linked=False)
    assert joined(MAX_LINKED_GAP, linked=True)  # blank lines and indentation, as splitters strip
    assert not joined(MAX_LINKED_GAP + 1, linked=True)
    (piece,) = stitch_chunks([a, b], [(0, 20), (23, 43)])
    assert piece.text == a + "\n\n\n" + b and (piece.start_char, piece.end_char) == (0, 43)
    assert piece.gaps == 1


def test_without_offsets_overlap_is_found_by_text():
    source = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu."
    a, b = source[:40], source[20:]
    (piece,) = stitch_chunks([a, b])
    assert piece.text == source and piece.gaps == 0
    # Too short to be told from coincidence: joined as neighbours with a newline instead.
    short = stitch_chunks([source[:30], source[30 - MIN_TEXT_OVERLAP + 1 :]])
    assert short[0].gaps == 1 and short[0].start_char is None


def test_chunk_inside_the_previous_one_is_kept_apart_not_dropped():
    # A splitter never emits a chunk with no new text: "cdef" placed inside the previous chunk
    # was put at an earlier copy of its text, and its real place is unknown. Dropping it as
    # "already covered" would lose that later copy, so it stands as its own piece.
    pieces = stitch_chunks(["abcdefghij", "cdef", "ijkl"], [(0, 10), (2, 6), (8, 12)])
    assert [p.text for p in pieces] == ["abcdefghij", "cdef", "ijkl"]
    assert [p.start_char for p in pieces[:2]] == [None, None]  # no range claimed for them


def test_repeated_text_placed_at_an_earlier_copy_loses_nothing():
    # Offsets as LlamaIndex's SentenceSplitter computed them for this text (seen in a fuzz
    # run): the chunk "end." was placed at the first "end." (66-70), not the second (71-75),
    # and linked to the next chunk across a 7-character "gap" that holds that second copy.
    text = "alpha gamma beta\nend.\nend.  x. beta alpha"
    first = text.index("end.")
    second = text.index("end.", first + 1)
    start = text.index("x.")
    texts = [text[: first + 4], "end.", text[start:]]
    spans = [(0, first + 4), (first, first + 4), (start, len(text))]
    assert start - (first + 4) == 7 and second > first
    pieces = stitch_chunks(texts, spans, [False, True, True])
    joined = "".join(p.text for p in pieces)
    assert joined.count("end.") >= 2  # the second copy is not refilled as whitespace


def test_distrusted_offsets_are_ignored():
    a, b = "first chunk of text.", "Then the next chunk."
    spans = [(0, 20), (22, 42)]
    assert len(stitch_chunks([a, b], spans)) == 1
    pieces = stitch_chunks([a, b], spans, [False, False], [False, True])
    assert len(pieces) == 2 and pieces[1].start_char is None


@pytest.mark.parametrize("linked", [True, False])
def test_empty_chunks_add_no_text(linked):
    """A chunk of no text neither joins nor breaks: once each one stood for a newline (and
    made its neighbours' offsets suspect, losing the range).
    """
    texts, spans = ["", "", "abc def", "", "ghi", ""], [(0, 0), (0, 0), (0, 7), (7, 7), (8, 11)]
    spans.append((11, 11))
    assert suspect_offsets(texts, spans) == [False] * 6
    [piece] = stitch_chunks(texts, spans, [linked] * 6)
    assert (piece.text, piece.start_char, piece.end_char) == ("abc def ghi", 0, 11)
    assert (piece.first, piece.stop, piece.gaps) == (0, 6, 1)
    assert [p.text for p in stitch_chunks(["", ""], None, [linked] * 2)] == [""]
    # Distrusted before an empty chunk stays distrusted after it: unlinked, no join by newline.
    pieces = stitch_chunks(["x" * 20, "", "y" * 20], None, [False] * 3, [True, False, False])
    assert [p.text for p in pieces] == ["x" * 20, "y" * 20]


def test_mismatched_inputs_are_errors():
    with pytest.raises(ValueError, match="one of each per chunk"):
        stitch_chunks(["a", "b"], [(0, 1)])
    assert stitch_chunks([])[0].text == ""


def test_a_table_of_repeated_rows_split_by_sentence_splitter_loses_no_row():
    # SentenceSplitter places each chunk by searching its text from the previous chunk's start:
    # on repeated rows it lands on an earlier copy (chunk 1 "at" 16 of a 185-character chunk 0),
    # and the overlap those offsets claimed agreed with the texts, so 169 characters of every
    # chunk were cut: 21 of 120 rows came back, with no word.
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    rows = [f"| row {i % 3} | value {i % 3} | same cell text here |" for i in range(120)]
    text = "\n".join(rows)
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=16).get_nodes_from_documents(
        [Document(text=text)]
    )
    texts, spans = parts(nodes)
    assert spans[1][0] < spans[0][1] - 100  # the offsets claim a long overlap
    assert all(suspect_offsets(texts, spans))
    pieces = stitch_chunks(texts, spans, [True] * len(nodes))
    joined = "".join(p.text for p in pieces)
    assert joined.count("| row") >= len(rows)  # nothing dropped (overlaps may show twice)
    assert all(p.start_char is None for p in pieces)  # and no range claimed for them


def test_one_overlap_joins_and_several_are_refused_without_offsets():
    prose = "the quick brown fox jumps over the lazy dog. "
    left, right = prose + "Then it ran far away.", "Then it ran far away. And slept."
    [piece] = stitch_chunks([left, right], None, [True, True])
    assert piece.text == prose + "Then it ran far away. And slept."
    periodic = "abcdefghij" * 6  # every 10-character shift is a suffix/prefix match
    [piece] = stitch_chunks([periodic, periodic + "end"], None, [False, False])
    assert piece.text == periodic + "\n" + periodic + "end"  # both whole: nothing cut unsure


#: Text that repeats: SentenceSplitter(chunk_size=38, chunk_overlap=8) places chunks 1 and 2 at
#: earlier copies of their text (12 and 15; they hold 28 and 55).
REPEATED = "東京は日本の首都です。" + "漢字かな交じり文" * 12 + "。大阪は第二の都市です。"


def repeated_chunks(place: bool = False):
    from llama_index.core import Document
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse.context.placement import place_chunks

    splitter = SentenceSplitter(chunk_size=38, chunk_overlap=8)
    nodes = splitter.get_nodes_from_documents([Document(text=REPEATED)])
    if place:
        place_chunks(REPEATED, nodes)
    return parts(nodes)


@pytest.mark.parametrize("run", [slice(2, 5), slice(0, 5)])
def test_repeated_text_is_joined_whole_never_refilled(run):
    # The splitter's offsets put a 33-character "gap" after chunk 2 (refilled with 33 newlines
    # where the document has text), and the text match cut 23 characters between chunks 0 and 1
    # where they share 7: 8 of the 12 copies came back.
    texts, spans = repeated_chunks()
    assert spans[1][0] == 12 and spans[2][0] == 15  # misplaced, as the splitter leaves them
    pieces = stitch_chunks(texts[run], spans[run], [True] * len(texts[run]))
    joined = "".join(p.text for p in pieces)
    for piece in pieces:
        if piece.start_char is not None:
            assert REPEATED[piece.start_char : piece.end_char] == piece.text
    assert "\n\n" not in joined  # joined whole, by one line break each, never refilled
    for text in texts[run]:
        assert text in joined
    if run == slice(0, 5):
        assert joined.count("漢字かな交じり文") >= 12  # no copy lost (overlaps may show twice)


def test_offsets_checked_at_ingestion_are_trusted_in_repeated_text():
    texts, spans = repeated_chunks(place=True)
    assert [start for start, _ in spans] == [0, 28, 55, 82, 100]
    assert suspect_offsets(texts, spans) == [True, True, True, True, False]  # unchecked
    (piece,) = stitch_chunks(texts, spans, [True] * 5, checked=[True] * 5)
    assert (piece.text, piece.start_char, piece.end_char) == (REPEATED, 0, len(REPEATED))
