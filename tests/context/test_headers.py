"""ContextualHeaders: the header is embedded, hidden from the answer LLM, and costs no repeat."""

from __future__ import annotations

from typing import Any

import pytest
from llama_index.core import Document
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.core.schema import MetadataMode

from llama_index.packs.self_rag_rse import ChunkIndexer, ContextualHeaders, DocumentSectioner
from llama_index.packs.self_rag_rse.context.cache import ContextCache
from llama_index.packs.self_rag_rse.context.keys import HEADER_KEY
from llama_index.packs.self_rag_rse.context.segment_header import segment_header


def _chunks(markdown: str, **metadata: Any) -> list[Any]:
    doc = Document(text=markdown, id_="herons", metadata=metadata)
    doc.excluded_llm_metadata_keys = ["file_path"]
    return list(DocumentSectioner(splitter=SentenceSplitter(chunk_size=64, chunk_overlap=0))([doc]))


def _fish(nodes: list[Any]) -> Any:
    return next(n for n in nodes if "grey heron" in n.text)


def test_embedded_text_is_header_then_chunk_and_the_llm_sees_the_chunk(markdown: str) -> None:
    nodes = ContextualHeaders()(_chunks(markdown, file_path="/data/birds/herons.md"))
    fish = _fish(nodes)
    header = "Document: Field guide to herons\nSection: Diet > Fish"
    assert fish.metadata["context_header"] == header
    assert fish.get_content(MetadataMode.EMBED) == f"{header}\n\n{fish.text}"
    assert fish.get_content(MetadataMode.LLM) == fish.text
    assert fish.get_content(MetadataMode.NONE) == fish.text
    assert "/data/birds" not in fish.get_content(MetadataMode.EMBED)  # paths stay out
    assert fish.metadata["file_path"] == "/data/birds/herons.md"  # but stay on the node
    intro = nodes[0]
    assert intro.metadata["context_header"] == "Document: Field guide to herons"


def test_title_sources_in_order(markdown: str) -> None:
    given = ContextualHeaders()(_chunks(markdown, title="Herons, a field guide"))
    assert given[0].metadata["document_title"] == "Herons, a field guide"  # yours wins
    no_heading = markdown.replace("# Field guide to herons\n", "Field notes\n")
    named = ContextualHeaders()(_chunks(no_heading, file_name="grey_herons-2024.md"))
    assert named[0].metadata["document_title"] == "grey herons 2024"
    only_file = ContextualHeaders(title_sources=["file_name"])(
        _chunks(markdown, file_name="herons.md")
    )
    assert only_file[0].metadata["document_title"] == "herons"
    no_section = ContextualHeaders(include_section=False)(_chunks(markdown))
    assert _fish(no_section).metadata["context_header"] == "Document: Field guide to herons"


def test_a_generated_document_id_is_no_title(markdown: str) -> None:
    # Document(text=...) from a reader that sets no file name, and no title heading: the title
    # was the document's random UUID, embedded with every chunk and shown in segment headers.
    no_heading = markdown.replace("# Field guide to herons\n", "Field notes\n")
    splitter = DocumentSectioner(splitter=SentenceSplitter(chunk_size=64, chunk_overlap=0))
    nodes = ContextualHeaders()(splitter([Document(text=no_heading)]))
    assert nodes[0].ref_doc_id and not nodes[0].metadata.get("document_title")
    assert not nodes[0].metadata.get("context_header", "").startswith("Document:")
    named = ContextualHeaders()(_chunks(no_heading))  # id_="herons", chosen by the user
    assert named[0].metadata["document_title"] == "herons"


def test_llm_titles_and_summaries_are_cached(markdown: str, scripted: Any, tmp_path: Any) -> None:
    def script(prompt: str) -> str:
        if "ten words" in prompt:
            return 'Title: "Herons"\n'
        if "This document" in prompt:
            return "This document describes herons.\nIgnored second line."
        return "This section is about " + prompt.split('section "', 1)[1].split('"', 1)[0] + "."

    no_heading = markdown.replace("# Field guide to herons\n", "Field notes\n")
    llm = scripted(script)
    headers = ContextualHeaders(
        llm=llm, document_summary=True, section_summary=True, cache=tmp_path
    )
    nodes = headers(_chunks(no_heading, file_name="x.md"))
    fish = _fish(nodes)
    assert fish.metadata["context_header"] == (
        "Document: Herons. This document describes herons.\n"
        "Section: Diet > Fish. This section is about Diet > Fish."
    )
    assert fish.get_content(MetadataMode.LLM) == fish.text
    calls = headers.usage.llm_calls
    assert calls == len(llm.prompts) == 1 + 1 + 3  # title, document summary, 3 sections
    again = ContextualHeaders(
        llm=scripted(script), document_summary=True, section_summary=True, cache=tmp_path
    )
    again(_chunks(no_heading, file_name="x.md"))
    assert again.usage.llm_calls == 0 and again.usage.cached == calls


def test_llm_answers_paid_for_are_kept_when_a_later_call_fails(
    markdown: str, scripted: Any, tmp_path: Any
) -> None:
    # The cache was written only after every call succeeded: one rate-limit error on the last
    # call lost every answer already paid for, and the rerun asked them all again.
    def failing(prompt: str) -> str:
        if 'section "Diet > Fish"' in prompt:
            raise RuntimeError("HTTP 429: rate limited")
        return "This section is short."

    headers = ContextualHeaders(llm=scripted(failing), section_summary=True, cache=tmp_path)
    with pytest.raises(RuntimeError, match="429"):
        headers(_chunks(markdown))
    again = ContextualHeaders(
        llm=scripted(lambda prompt: "This section is short."), section_summary=True, cache=tmp_path
    )
    again(_chunks(markdown))
    assert again.usage.cached >= 1 and again.usage.llm_calls >= 1  # the failed one is asked again


async def test_llm_calls_stay_within_num_workers(markdown: str, scripted: Any) -> None:
    llm = scripted(lambda prompt: "This section is short.", delay=0.02)
    headers = ContextualHeaders(llm=llm, section_summary=True, num_workers=2)
    docs = [_chunks(markdown.replace("herons", f"herons {i}")) for i in range(3)]
    for i, nodes in enumerate(docs):
        for node in nodes:
            node.relationships = {}  # no source: each chunk is its own document
            node.id_ = f"{i}-{node.id_}"
    await headers.acall([n for nodes in docs for n in nodes], show_progress=True)
    assert llm.max_active == 2


def test_options_are_checked(scripted: Any) -> None:
    with pytest.raises(TypeError, match="did you mean 'section_summary'"):
        ContextualHeaders(section_summaries=True)
    with pytest.raises(ValueError, match="document_summary needs an llm"):
        ContextualHeaders(document_summary=True)
    with pytest.raises(ValueError, match="title_sources 'llm' needs an llm"):
        ContextualHeaders(title_sources=["llm"])
    with pytest.raises(ValueError, match="max_llm_chars must be at least 1"):
        ContextualHeaders(max_llm_chars=0)
    with pytest.raises(TypeError, match="cache must be"):
        ContextualHeaders(cache=3)
    assert isinstance(ContextualHeaders(cache=None).cache, ContextCache)


def test_whole_documents_before_the_splitter_are_refused_naming_the_fix(markdown: str) -> None:
    # The header would name no section and be copied into every chunk by the splitter.
    pipeline = IngestionPipeline(
        transformations=[ContextualHeaders(), SentenceSplitter(chunk_size=64, chunk_overlap=0)]
    )
    with pytest.raises(ValueError, match="Put ContextualHeaders after the splitter or Document"):
        pipeline.run(documents=[Document(text=markdown, id_="herons")])


def test_chunks_of_a_plain_splitter_get_headers(markdown: str) -> None:
    pipeline = IngestionPipeline(
        transformations=[
            SentenceSplitter(chunk_size=64, chunk_overlap=0),
            ChunkIndexer(),
            ContextualHeaders(),
        ]
    )
    document = Document(text=markdown, id_="herons", metadata={"file_name": "herons.md"})
    nodes = pipeline.run(documents=[document])
    assert nodes and all(n.metadata[HEADER_KEY] == "Document: herons" for n in nodes)


def test_a_section_path_given_as_text_is_one_section() -> None:
    # A reader may set section_path to a string; it is one title, not a path of letters.
    document = Document(text="x.", metadata={"section_path": "Intro", "title": "T"})
    (node,) = ContextualHeaders()(SentenceSplitter()([document]))
    assert node.metadata[HEADER_KEY] == "Document: T\nSection: Intro"
    assert segment_header(node) == "Document: T\nSection: Intro"  # the segment's header too


@pytest.mark.parametrize(
    ("answer", "kept"),
    [
        ('Title: "Herons"\n', "Herons"),
        ("**Title:** Herons of the marsh", "Herons of the marsh"),  # used to keep "** Herons..."
        ("## Title: Herons", "Herons"),
        (
            "Here is a one-sentence summary:\n\nThis document describes herons.",
            "This document describes herons.",
        ),  # the preamble used to be the summary
        ("**Summary:** Herons eat fish.\nMore.", "Herons eat fish."),
        ("Title:\nHerons", "Herons"),
        ("Herons: a field guide", "Herons: a field guide"),
        ("Ends with a colon:", "Ends with a colon:"),  # nothing after it: kept
        ("", ""),
    ],
)
def test_a_chatty_answer_gives_its_title_or_summary(answer: str, kept: str) -> None:
    from llama_index.packs.self_rag_rse.context.headers import _first_line

    assert _first_line(answer, 200) == kept


def test_from_dict_of_to_dict_is_the_same_transformation(markdown: str, tmp_path: Any) -> None:
    """A transformation in a saved pipeline is rebuilt from its dict: the prompts came back as
    dicts of an abstract class and ContextualHeaders.from_dict failed.
    """
    from llama_index.core.prompts import PromptTemplate

    headers = ContextualHeaders(
        title_prompt=PromptTemplate("Title this: {text}"), include_section=False, cache=tmp_path
    )
    for rebuilt in (
        ContextualHeaders.from_dict(headers.to_dict()),
        ContextualHeaders.from_json(headers.to_json()),
    ):
        assert rebuilt.to_dict() == headers.to_dict()
        assert rebuilt.title_prompt.format(text="x") == "Title this: x"
        assert rebuilt.cache.persist_path == headers.cache.persist_path
        chunks = _chunks(markdown)
        assert [n.metadata[HEADER_KEY] for n in rebuilt(chunks)] == [
            n.metadata[HEADER_KEY] for n in headers(_chunks(markdown))
        ]


def test_from_dict_asks_for_the_llm_it_cannot_rebuild(scripted: Any) -> None:
    llm = scripted(lambda prompt: "Herons")
    data = ContextualHeaders(llm=llm).to_dict()
    with pytest.raises(ValueError, match=r"from_dict\(data, llm=\.\.\.\)"):
        ContextualHeaders.from_dict(data)
    assert ContextualHeaders.from_dict(data, llm=llm).llm is llm
