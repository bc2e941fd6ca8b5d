"""What the engine does with bad options and bad inputs: clear errors or visible degradations."""

from __future__ import annotations

import asyncio
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import FixedRetriever, make_nodes
from scripted import BlockingCritic

from llama_index.packs.self_rag_rse import SelfRAGPack, SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.common.notes import record_note


@pytest.mark.parametrize(
    ("option", "closest"),
    [("treshold", "threshold"), ("w_rell", "w_rel"), ("max_new_token", "max_new_tokens")],
)
def test_unknown_option_names_the_closest_valid_one(tiny_llm, option, closest):
    with pytest.raises(TypeError, match=rf"'{option}' \(did you mean '{closest}'\?\)"):
        SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever(), **{option: 0.2})


def test_unknown_option_through_the_pack(tiny_gguf_paths):
    with pytest.raises(TypeError, match=r"'treshold' \(did you mean 'threshold'\?\)"):
        SelfRAGPack(str(tiny_gguf_paths["user_defined"]), FixedRetriever(), treshold=0.2)


@pytest.mark.parametrize("name", ["w_rel", "w_sup", "w_use", "support_threshold"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_weights_are_rejected(tiny_llm, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever(), **{name: value})


@pytest.mark.parametrize("query", [None, 42, ["a question"]])
def test_non_text_query_is_refused_before_any_event(tiny_llm, events, query):
    engine = SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever())
    with pytest.raises(TypeError, match="query must be a string or a QueryBundle"):
        engine.query(query)
    assert "QueryStartEvent" not in events


async def test_non_text_query_is_refused_by_aquery(tiny_llm):
    engine = SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever())
    with pytest.raises(TypeError, match="query must be a string"):
        await engine.aquery(None)  # type: ignore[arg-type]


def test_empty_paragraphs_are_skipped_and_traced(tiny_llm):
    nodes = [
        NodeWithScore(node=TextNode(id_="blank", text="   \n", metadata={"title": "t"}), score=0.9),
        *make_nodes(),
    ]
    engine = SelfRAGQueryEngine(
        llm=tiny_llm, retriever=FixedRetriever(nodes), mode="always_retrieve"
    )
    meta = engine.query("What does the while statement do?").metadata["self_rag"]
    assert "blank" not in [p["node_id"] for p in meta["paragraphs"]]
    skipped = [e for e in meta["trace"] if e["step"] == "skip_empty"]
    assert skipped == [
        {"step": "skip_empty", "node_ids": ["blank"], "reason": "paragraph has no text"}
    ]


def test_only_empty_paragraphs_fall_back_with_the_reason(tiny_llm):
    nodes = [NodeWithScore(node=TextNode(id_="blank", text=""), score=0.9)]
    engine = SelfRAGQueryEngine(
        llm=tiny_llm, retriever=FixedRetriever(nodes), mode="always_retrieve"
    )
    meta = engine.query("q").metadata["self_rag"]
    assert meta["paragraphs"] == [] and meta["best"] is None
    assert {"step": "fallback", "reason": "every retrieved paragraph was empty"} in meta["trace"]


class DropAll(BaseNodePostprocessor):
    """Keeps nothing and says why, as RelevantSegmentPostprocessor does."""

    def _postprocess_nodes(self, nodes, query_bundle=None):
        record_note("DropAll", "best segment value 0.31 < minimum_value 0.5")
        return []


def test_a_postprocessor_that_keeps_nothing_is_named_in_the_trace(tiny_llm):
    engine = SelfRAGQueryEngine(
        llm=tiny_llm,
        retriever=FixedRetriever(),
        mode="always_retrieve",
        node_postprocessors=[DropAll()],
    )
    meta = engine.query("q").metadata["self_rag"]
    retrieve = next(e for e in meta["trace"] if e["step"] == "retrieve")
    assert retrieve["nodes"] == 0 and retrieve["retrieved"] == 3
    assert retrieve["dropped_by"] == "DropAll"
    reason = (
        "DropAll kept none of the 3 retrieved nodes: best segment value 0.31 < minimum_value 0.5"
    )
    assert retrieve["reason"] == reason
    assert {"step": "fallback", "reason": reason} in meta["trace"]


async def test_a_postprocessor_that_keeps_nothing_under_aquery(tiny_llm):
    engine = SelfRAGQueryEngine(
        llm=tiny_llm,
        retriever=FixedRetriever(),
        mode="always_retrieve",
        node_postprocessors=[DropAll()],
    )
    meta = (await engine.aquery("q")).metadata["self_rag"]
    assert any(e.get("dropped_by") == "DropAll" for e in meta["trace"])


class Recording(BlockingCritic):
    """A critic that records the paragraphs it judges."""

    name = "recording"

    def __init__(self) -> None:
        self.paragraphs: list[str] = []

    def decide_retrieval(self, query: str, threshold: Any, answer_if_skipped: bool = True):
        from llama_index.packs.self_rag_rse import RetrievalDecision

        return RetrievalDecision(retrieve=True)

    def judge(self, query: str, paragraphs: list[str]):
        from llama_index.packs.self_rag_rse import ParagraphJudgement

        self.paragraphs = list(paragraphs)
        return [ParagraphJudgement("a", 1.0, 1.0, 1.0) for _ in paragraphs]

    def generate(self, query: str) -> str:
        return "alone"


@pytest.mark.parametrize(
    ("title_key", "first_lines"),
    [
        (None, ["body one", "body two", "body three"]),
        ("heading", ["H", "body two", "body three"]),
        (["title", "document_title"], ["T", "D", "body three"]),
    ],
)
def test_title_key_chooses_the_paragraph_title_line(title_key, first_lines):
    nodes = [
        NodeWithScore(
            node=TextNode(id_="1", text="body one", metadata={"title": "T", "heading": "H"}),
            score=0.9,
        ),
        NodeWithScore(
            node=TextNode(id_="2", text="body two", metadata={"document_title": "D"}), score=0.8
        ),
        NodeWithScore(
            node=TextNode(id_="3", text="body three", metadata={"title": " "}), score=0.7
        ),
    ]
    critic = Recording()
    engine = SelfRAGQueryEngine(retriever=FixedRetriever(nodes), critic=critic, title_key=title_key)
    engine.query("q")
    assert [p.split("\n")[0] for p in critic.paragraphs] == first_lines


def test_default_title_keys_fall_back_to_document_title():
    nodes = [
        NodeWithScore(node=TextNode(id_="2", text="x", metadata={"document_title": "D"}), score=1.0)
    ]
    critic = Recording()
    SelfRAGQueryEngine(retriever=FixedRetriever(nodes), critic=critic).query("q")
    assert critic.paragraphs == ["D\nx"]


def test_partial_reflection_vocabulary_warns_naming_the_missing_tokens(tmp_path: Path):
    from conftest import _llama
    from tiny_gguf import write_tiny_gguf

    llm = _llama(write_tiny_gguf(tmp_path / "partial.gguf", typing="partial"))
    try:
        with pytest.warns(UserWarning, match=r"missing: \[Irrelevant\], \[Relevant\]"):
            engine = SelfRAGQueryEngine(llm=llm, retriever=FixedRetriever())
        assert engine.critic.name == "prompted"
        engine.close()
    finally:
        llm.close()


def test_model_without_reflection_tokens_falls_back_quietly(tiny_llm_plain):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = SelfRAGQueryEngine(llm=tiny_llm_plain, retriever=FixedRetriever())
    assert engine.critic.name == "prompted"
    engine.close()


def test_rse_keeping_nothing_is_explained_in_the_trace():
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor

    nodes = []
    for i in range(3):
        text = f"chunk {i} " + "text " * 10
        node = TextNode(
            id_=f"c{i}",
            text=text,
            start_char_idx=i * len(text),
            end_char_idx=(i + 1) * len(text),
            metadata={"chunk_index": i},
        )
        node.relationships[NodeRelationship.SOURCE] = RelatedNodeInfo(node_id="doc")
        nodes.append(NodeWithScore(node=node, score=0.3))
    critic = Recording()
    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(nodes),
        critic=critic,
        node_postprocessors=[RelevantSegmentPostprocessor(minimum_value=5.0)],
    )
    meta = engine.query("q").metadata["self_rag"]
    retrieve = next(e for e in meta["trace"] if e["step"] == "retrieve")
    assert retrieve["dropped_by"] == "RelevantSegmentPostprocessor"
    assert retrieve["reason"].startswith(
        "RelevantSegmentPostprocessor kept none of the 3 retrieved nodes: "
    )
    assert "minimum_value" in retrieve["reason"]
    assert critic.paragraphs == []


def test_a_retriever_that_cannot_retrieve_is_rejected_at_construction():
    with pytest.raises(TypeError, match=r"retriever must be a LlamaIndex retriever.*got str"):
        SelfRAGQueryEngine(retriever="x", critic=Recording())


def test_a_critic_of_the_wrong_type_gets_its_own_reason():
    with pytest.raises(TypeError, match=r"critic must be .* a built critic .*got int"):
        SelfRAGQueryEngine(retriever=FixedRetriever(), critic=42)


class Returns(FixedRetriever):
    """A retriever returning whatever it was given, as a broken one might."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value

    def _retrieve(self, query_bundle: Any) -> Any:
        return self.value

    async def _aretrieve(self, query_bundle: Any) -> Any:
        return self.value


class DuckReturns:
    """Not a BaseRetriever: only retrieve()/aretrieve(), returning whatever it was given."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def retrieve(self, query_bundle: Any) -> Any:
        return self.value

    async def aretrieve(self, query_bundle: Any) -> Any:
        return self.value


@pytest.mark.parametrize("value", [None, [TextNode(text="x")]])
@pytest.mark.parametrize("kind", [Returns, DuckReturns])
def test_a_retriever_returning_no_list_of_nodes_names_itself(kind: Any, value: Any):
    engine = SelfRAGQueryEngine(retriever=kind(value), critic=Recording())
    pattern = rf"{kind.__name__} (returned|failed).*must return .*NodeWithScore"
    with pytest.raises(TypeError, match=pattern):
        engine.query("q")
    with pytest.raises(TypeError, match=pattern):
        asyncio.run(engine.aquery("q"))


def test_a_postprocessor_returning_none_names_itself():
    class Nothing(BaseNodePostprocessor):
        def _postprocess_nodes(self, nodes, query_bundle=None):
            return None

    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(), critic=Recording(), node_postprocessors=[Nothing()]
    )
    with pytest.raises(TypeError, match="Nothing returned NoneType"):
        engine.query("q")
