"""A paragraph whose logits are NaN (a damaged GGUF, an fp16 overflow) fails; it never wins.

The model is a tiny Self-RAG GGUF whose embedding rows for "Z" and "▁Z" are NaN, so a
paragraph made of Z-words makes llama.cpp return NaN logits for every question asked about it.
A NaN score would win or lose ``max()`` and a sort by where it stands in the list.
"""

from __future__ import annotations

import math
import shutil

import pytest
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import FixedRetriever, make_nodes
from tiny_gguf import write_tiny_gguf

from llama_index.packs.self_rag_rse import (
    BaseCritic,
    ParagraphJudgement,
    RetrievalDecision,
    SelfRAGQueryEngine,
)

gguf = pytest.importorskip("gguf")
llama_cpp = pytest.importorskip("llama_cpp")
np = pytest.importorskip("numpy")

QUESTION = "How do the while and for statements differ?"


@pytest.fixture(scope="module")
def nan_llm(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("nan")
    clean, broken = folder / "clean.gguf", folder / "nan.gguf"
    write_tiny_gguf(clean, seed=3, long_form=True)
    shutil.copy(clean, broken)
    reader = gguf.GGUFReader(str(broken), "r+")
    field = reader.fields["tokenizer.ggml.tokens"]
    vocab = [bytes(field.parts[i]).decode() for i in field.data]
    embeddings = next(t for t in reader.tensors if t.name == "token_embd.weight")
    for piece in ("Z", "\u2581Z"):
        embeddings.data[vocab.index(piece), :] = np.nan
    del reader  # writes the memory map back
    llm = llama_cpp.Llama(str(broken), n_ctx=1024, n_threads=1, n_threads_batch=1, verbose=False)
    yield llm
    llm.close()


def _hits() -> list[NodeWithScore]:
    nan = NodeWithScore(node=TextNode(id_="nan", text="Zzz Zebra Zone."), score=0.95)
    return [nan, *make_nodes()]


def test_nan_logits_fail_their_paragraph_in_the_short_form(nan_llm) -> None:
    with SelfRAGQueryEngine(
        llm=nan_llm, retriever=FixedRetriever(_hits()), mode="always_retrieve"
    ) as engine:
        response = engine.query(QUESTION)
    rows = {row["node_id"]: row for row in response.metadata["self_rag"]["paragraphs"]}
    assert rows["nan"]["score"] is None and "NaN" in rows["nan"]["error"]
    assert all(math.isfinite(r["score"]) for k, r in rows.items() if k != "nan")
    assert [s.node.node_id for s in response.source_nodes][-1] == "nan"
    assert response.source_nodes[-1].score is None


def test_nan_logits_never_lead_the_long_form_beam(nan_llm) -> None:
    with SelfRAGQueryEngine(
        llm=nan_llm, retriever=FixedRetriever(_hits()), mode="always_retrieve", long_form=True
    ) as engine:
        response = engine.query(QUESTION)
    meta = response.metadata["self_rag"]
    assert meta["path_score"] is not None and math.isfinite(meta["path_score"])
    depth = next(t for t in meta["trace"] if t["step"] == "depth")
    nan_path = next(c for c in depth["candidates"] if c["node_ids"] == ["nan"])
    assert nan_path["path_score"] == -math.inf and not nan_path["kept"]


class _NaNFirstCritic(BaseCritic):
    """A critic (the documented extension point) that cannot read paragraph 0."""

    name = "nan-first"

    async def adecide_retrieval(self, query, threshold, answer_if_skipped=True):
        return RetrievalDecision(True, 1.0)

    async def ajudge(self, query, paragraphs):
        relevance = [math.nan, 0.2, 0.9]
        return [ParagraphJudgement(f"answer {i}", relevance[i], 0.5, 0.0) for i in range(3)]

    async def agenerate(self, query):
        return "an answer without evidence"


def test_a_critics_nan_score_does_not_win_by_standing_first() -> None:
    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(make_nodes()[:3]), critic=_NaNFirstCritic(), mode="always_retrieve"
    )
    response = engine.query(QUESTION)
    assert response.response == "answer 2"
    assert "NaN" in response.metadata["self_rag"]["paragraphs"][0]["error"]
