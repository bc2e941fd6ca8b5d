"""What the engine does with bad options and bad inputs: clear errors or visible degradations."""

from __future__ import annotations

import asyncio
import math
import re
import warnings
from pathlib import Path
from typing import Any

import pytest
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.schema import NodeWithScore, TextNode
from retrievers import FixedRetriever, make_nodes
from scripted import BlockingCritic

from llama_index.packs.self_rag_rse import ReflectionCritic, SelfRAGPack, SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.common.notes import record_note


@pytest.mark.parametrize(
    ("option", "closest"),
    [("treshold", "threshold"), ("w_rell", "w_rel"), ("max_new_token", "max_new_tokens")],
)
def test_unknown_option_names_the_closest_valid_one(make_engine, option, closest):
    with pytest.raises(TypeError, match=rf"'{option}' \(did you mean '{closest}'\?\)"):
        make_engine(**{option: 0.2})
    engine = make_engine()
    with pytest.raises(TypeError, match=rf"'{option}' \(did you mean '{closest}'\?\)"):
        setattr(engine, option, 0.2)  # a misspelt option set later is refused too


def test_unknown_option_through_the_pack(tiny_gguf_paths):
    with pytest.raises(TypeError, match=r"'treshold' \(did you mean 'threshold'\?\)"):
        SelfRAGPack(str(tiny_gguf_paths["user_defined"]), FixedRetriever(), treshold=0.2)


@pytest.mark.parametrize(
    ("option", "closest"), [("nctx", "n_ctx"), ("n_gpu_layer", "n_gpu_layers")]
)
def test_a_misspelt_model_kwargs_option_names_the_closest_one(tiny_gguf_paths, option, closest):
    # llama_cpp.Llama takes **kwargs and drops what it does not know: a misspelt n_ctx used to
    # load the model with the default context (n_gpu_layer: on the GPU anyway), without a word.
    path = str(tiny_gguf_paths["user_defined"])
    message = rf"model_kwargs got unknown option '{option}' \(did you mean '{closest}'\?\)"
    with pytest.raises(TypeError, match=message):
        SelfRAGQueryEngine(path, FixedRetriever(), model_kwargs={option: 512})
    with pytest.raises(TypeError, match=message):
        SelfRAGPack(path, FixedRetriever(), model_kwargs={"n_threads": 1, option: 0})
    SelfRAGQueryEngine(path, FixedRetriever(), model_kwargs={"n_ctx": 512, "n_threads": 1}).close()


@pytest.mark.parametrize("name", ["w_rel", "w_sup", "w_use", "support_threshold"])
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_weights_are_rejected(make_engine, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        make_engine(**{name: value})


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("ndocs", 0, "ndocs must be at least 1 or None, got 0"),
        ("threshold", 2.0, r"threshold must be in \[0, 1\], the scale it is read on, got 2.0"),
        ("rewrite_threshold", 5.0, r"rewrite_threshold must be in \[0, 1\].*got 5.0"),
        ("support_threshold", -0.5, r"support_threshold must be in \[0, 1\].*got -0.5"),
        ("utility_threshold", 4.0, r"utility_threshold must be in \[-1, 1\].*got 4.0"),
        ("w_sup", math.nan, "w_sup must be a finite number"),
        ("max_new_tokens", 0, "max_new_tokens must be at least 1"),
        ("max_new_tokens", 7, r"read once, when the critic is built.*max_new_tokens=7"),
        ("ndocs", True, "ndocs must be a number, got True"),
        ("threshold", True, "threshold must be a number, got True"),
        ("w_rel", False, "w_rel must be a number, got False"),
        ("max_retrieval_rounds", 0, "max_retrieval_rounds must be at least 1"),
        ("beam_width", 0, "beam_width must be at least 1"),
        # Read as no regeneration (-3) and as 1 (True) without a word.
        ("max_regenerations", -3, "max_regenerations\n.*greater than or equal to 0"),
        ("max_regenerations", True, "max_regenerations must be a number, got True"),
        ("mode", "sometimes", "mode"),
        ("segment_retrieval", "each", "segment_retrieval"),
        ("long_form", True, r"needs a Self-RAG model.*long_form=False"),
    ],
)
def test_an_option_set_after_construction_is_checked(option, value, message):
    engine = SelfRAGQueryEngine(retriever=FixedRetriever(), critic=Recording())
    before = getattr(engine, option)
    with pytest.raises(ValueError, match=message):
        setattr(engine, option, value)
    assert getattr(engine, option) == before  # the engine keeps its last valid setting


@pytest.fixture
def long_form_critic(tiny_llm):
    from llama_index.packs.self_rag_rse import ReflectionCritic

    with ReflectionCritic(tiny_llm) as critic:
        yield critic


def test_options_checked_together_are_checked_on_assignment(long_form_critic):
    engine = SelfRAGQueryEngine(retriever=FixedRetriever(), critic=long_form_critic)
    engine.long_form = True  # this critic writes segments
    with pytest.raises(ValueError, match="cannot be combined"):
        engine.corrective = True
    assert engine.corrective is False and engine.long_form is True
    with pytest.raises(TypeError, match="retriever must be a LlamaIndex retriever"):
        engine.retriever = "x"


@pytest.mark.parametrize("query", [None, 42, ["a question"]])
def test_non_text_query_is_refused_before_any_event(make_engine, events, query):
    engine = make_engine()
    with pytest.raises(TypeError, match="query must be a string or a QueryBundle"):
        engine.query(query)
    assert "QueryStartEvent" not in events


def test_a_lone_surrogate_in_the_query_is_refused_before_any_event(make_engine, events):
    # What decoding bytes with errors="surrogateescape" leaves: no model can read it.
    with pytest.raises(ValueError, match="lone surrogate at 8: decode it with errors='replace'"):
        make_engine().query("what is \udcff while")
    assert "QueryStartEvent" not in events


async def test_non_text_query_is_refused_by_aquery(make_engine):
    engine = make_engine()
    with pytest.raises(TypeError, match="query must be a string"):
        await engine.aquery(None)  # type: ignore[arg-type]


def test_empty_paragraphs_are_skipped_and_traced(make_engine):
    nodes = [
        NodeWithScore(node=TextNode(id_="blank", text="   \n", metadata={"title": "t"}), score=0.9),
        *make_nodes(),
    ]
    engine = make_engine(retriever=FixedRetriever(nodes))
    meta = engine.query("What does the while statement do?").metadata["self_rag"]
    assert "blank" not in [p["node_id"] for p in meta["paragraphs"]]
    skipped = [e for e in meta["trace"] if e["step"] == "skip_empty"]
    assert skipped == [
        {"step": "skip_empty", "node_ids": ["blank"], "reason": "paragraph has no text"}
    ]


async def test_a_query_bundle_reaches_the_retriever_whole(make_engine):
    # HyDE through core's TransformQueryEngine: the engine rebuilt the bundle from its text, so
    # the hypothetical document (custom_embedding_strs) never reached the retriever.
    from llama_index.core.indices.query.query_transform import HyDEQueryTransform
    from llama_index.core.llms import MockLLM
    from llama_index.core.query_engine import TransformQueryEngine

    retriever = FixedRetriever()
    hyde = HyDEQueryTransform(llm=MockLLM(max_tokens=8))
    engine = TransformQueryEngine(make_engine(retriever=retriever), query_transform=hyde)
    engine.query("What does the while statement do?")
    await engine.aquery("What does the while statement do?")
    for bundle in retriever.bundles:
        assert bundle.query_str == "What does the while statement do?"
        assert len(bundle.custom_embedding_strs or []) == 2  # the hypothesis and the question
    assert len(retriever.bundles) == 2


def test_empty_paragraphs_do_not_take_the_places_ndocs_gives(make_engine):
    # An image node (or an empty chunk) ranked first took one of the ndocs places: with ndocs=1
    # nothing was judged and the model answered alone, "every retrieved paragraph was empty".
    blank = NodeWithScore(node=TextNode(id_="blank", text=""), score=0.95)
    texts = make_nodes()
    engine = make_engine(retriever=FixedRetriever([blank, *texts]), ndocs=1)
    meta = engine.query("What does the while statement do?").metadata["self_rag"]
    assert [p["node_id"] for p in meta["paragraphs"]] == [texts[0].node.node_id]


def test_only_empty_paragraphs_fall_back_with_the_reason(make_engine):
    nodes = [NodeWithScore(node=TextNode(id_="blank", text=""), score=0.9)]
    engine = make_engine(retriever=FixedRetriever(nodes))
    meta = engine.query("q").metadata["self_rag"]
    assert meta["paragraphs"] == [] and meta["best"] is None
    assert {"step": "fallback", "reason": "every retrieved paragraph was empty"} in meta["trace"]


class DropAll(BaseNodePostprocessor):
    """Keeps nothing and says why, as RelevantSegmentPostprocessor does."""

    def _postprocess_nodes(self, nodes, query_bundle=None):
        record_note("DropAll", "best segment value 0.31 < minimum_value 0.5")
        return []


def test_a_postprocessor_that_keeps_nothing_is_named_in_the_trace(make_engine):
    engine = make_engine(node_postprocessors=[DropAll()])
    meta = engine.query("q").metadata["self_rag"]
    retrieve = next(e for e in meta["trace"] if e["step"] == "retrieve")
    assert retrieve["nodes"] == 0 and retrieve["retrieved"] == 3
    assert retrieve["dropped_by"] == "DropAll"
    reason = (
        "DropAll kept none of the 3 retrieved nodes: best segment value 0.31 < minimum_value 0.5"
    )
    assert retrieve["reason"] == reason
    assert {"step": "fallback", "reason": reason} in meta["trace"]


async def test_a_postprocessor_that_keeps_nothing_under_aquery(make_engine):
    engine = make_engine(node_postprocessors=[DropAll()])
    meta = (await engine.aquery("q")).metadata["self_rag"]
    retrieve = next(e for e in meta["trace"] if e["step"] == "retrieve")
    assert retrieve["nodes"] == 0 and retrieve["retrieved"] == 3
    assert retrieve["dropped_by"] == "DropAll"
    reason = (
        "DropAll kept none of the 3 retrieved nodes: best segment value 0.31 < minimum_value 0.5"
    )
    assert retrieve["reason"] == reason
    assert {"step": "fallback", "reason": reason} in meta["trace"]


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


def test_partial_reflection_vocabulary_warns_naming_the_missing_tokens(
    tmp_path: Path, open_llama, make_engine
):
    from tiny_gguf import write_tiny_gguf

    llm = open_llama(write_tiny_gguf(tmp_path / "partial.gguf", typing="partial"))
    with pytest.warns(UserWarning, match=r"missing: \[Irrelevant\], \[Relevant\]"):
        engine = make_engine(llm=llm)
    assert engine.critic.name == "prompted"


def test_auto_with_a_generator_llm_on_a_self_rag_model_warns_it_is_not_reflecting(
    tiny_llm, tiny_llm_plain, make_engine, caplog
):
    # generator_llm= means the prompted critic, even on a model that could score with its own
    # reflection tokens: that used to happen silently.
    message = (
        r"reflection tokens.*generator_llm=.*prompted critic.*drop generator_llm=.*"
        r"critic='prompted'"
    )
    with pytest.warns(UserWarning, match=message):
        engine = make_engine(llm=tiny_llm, generator_llm=tiny_llm_plain)
    assert engine.critic.name == "prompted"
    assert len([r for r in caplog.records if "generator_llm=" in r.getMessage()]) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # Asked for by name, or a model without the tokens: nothing to say.
        make_engine(llm=tiny_llm, generator_llm=tiny_llm_plain, critic="prompted")
        make_engine(llm=tiny_llm_plain, generator_llm=tiny_llm)


def test_model_without_reflection_tokens_falls_back_quietly(tiny_llm_plain, make_engine):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine = make_engine(llm=tiny_llm_plain)
    assert engine.critic.name == "prompted"


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


def test_a_retrievers_own_failure_goes_on_as_it_is():
    # An AttributeError inside the retriever (an unconnected client) came out as a TypeError
    # saying the retriever must not return None, which it never did.
    from llama_index.core.base.base_retriever import BaseRetriever

    class Unconnected(BaseRetriever):
        client = None

        def _retrieve(self, query_bundle):
            return self.client.query_points(query_bundle.query_str)

    engine = SelfRAGQueryEngine(retriever=Unconnected(), critic=Recording())
    with pytest.raises(AttributeError, match="'NoneType' object has no attribute 'query_points'"):
        engine.query("q")
    with pytest.raises(AttributeError, match="query_points"):
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


@pytest.mark.parametrize("returned", ["one of three", None, "abc"])
def test_a_critic_that_breaks_the_judgement_contract_is_named(returned):
    from llama_index.packs.self_rag_rse import ParagraphJudgement

    one = [ParagraphJudgement("only one", 0.9, 0.9, 1.0)]

    class Short(Recording):
        def judge(self, query, paragraphs):
            return one if returned == "one of three" else returned

    engine = SelfRAGQueryEngine(retriever=FixedRetriever(), critic=Short(), mode="always_retrieve")
    with pytest.raises(TypeError, match=r"Short.ajudge must return one ParagraphJudgement per "):
        engine.query("What does the while statement do?")


class Breaking(Recording):
    """Keeps the contract on the first judgement, then breaks it where ``broken`` says."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def judge(self, query, paragraphs):
        from llama_index.packs.self_rag_rse import ParagraphJudgement

        if self.broken == "answer":
            return [ParagraphJudgement(None, 0.9, 0.9, 1.0) for _ in paragraphs]  # type: ignore
        relevance = 0.1 if self.broken == "rewrite" else 0.9
        judged = [ParagraphJudgement("a", relevance, 0.1, 1.0) for _ in paragraphs]
        # The regeneration judges the chosen paragraph alone (the retriever gives three).
        return [] if self.broken == "regenerate" and len(paragraphs) == 1 else judged

    def generate(self, query):
        return None if self.broken == "rewrite" else "alone"

    writes_segments = True

    async def astart_path(self, query):
        return (1,)

    async def awrite_segments(self, branches, boundary_threshold):
        from llama_index.packs.self_rag_rse.critic.contract import Continuation

        return [Continuation("a segment", 0.9, 0.9, 1.0, stop="eos")]  # one for three branches


@pytest.mark.parametrize(
    ("broken", "options", "message"),
    [
        ("answer", {}, r"Breaking.ajudge must return one ParagraphJudgement per paragraph \(3\)"),
        ("regenerate", {"corrective": True}, r"Breaking.ajudge must return one .* \(1\)"),
        ("rewrite", {"corrective": True}, r"Breaking.agenerate must return text; .* None"),
        ("segments", {"long_form": True}, r"Breaking.awrite_segments must return one .* \(3\)"),
    ],
)
def test_a_critic_that_breaks_the_contract_later_in_the_flow_is_named(broken, options, message):
    # An answer that is no text, the corrective loop's regeneration and rewrite, long form's
    # segments: each used to fail deep in the flow (AttributeError, a failed unpacking, a
    # StopIteration turned RuntimeError) instead of naming the critic and the contract.
    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(), critic=Breaking(broken), mode="always_retrieve", **options
    )
    with pytest.raises(TypeError, match=message):
        engine.query("What does the while statement do?")
    with pytest.raises(TypeError, match=message):
        asyncio.run(engine.aquery("What does the while statement do?"))


def test_no_postprocessors_may_be_said_with_none():
    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(), critic=Recording(), node_postprocessors=None
    )
    assert engine.node_postprocessors == []
    assert engine.query("What does the while statement do?").source_nodes


@pytest.mark.parametrize("broken", ["gate", "answer"])
def test_a_critic_that_returns_the_wrong_type_is_named(broken):
    class Wrong(Recording):
        def decide_retrieval(self, query, threshold, answer_if_skipped=True):
            return True if broken == "gate" else super().decide_retrieval(query, threshold)

        def generate(self, query):
            return None

    mode = "adaptive_retrieval" if broken == "gate" else "no_retrieval"
    engine = SelfRAGQueryEngine(retriever=FixedRetriever(), critic=Wrong(), mode=mode)
    expected = "adecide_retrieval must return a RetrievalDecision, got True"
    if broken == "answer":
        expected = r"Wrong.agenerate, .astream_generate and .ajudge must give text, got None"
    with pytest.raises(TypeError, match=expected):
        engine.query("What does the while statement do?")


@pytest.mark.parametrize("pieces", [[None], ["an answer", None], [b"bytes"], [7, "x"]])
def test_a_critic_whose_stream_yields_no_text_is_named(pieces):
    # A streamed piece that is no text used to fail in the stream's whitespace handling:
    # AttributeError: 'NoneType' object has no attribute 'lstrip', or a failed concatenation.
    class Streaming(Recording):
        async def astream_generate(self, query):
            for piece in pieces:
                yield piece

    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(), critic=Streaming(), mode="no_retrieval", streaming=True
    )
    wrong = next(piece for piece in pieces if not isinstance(piece, str))
    expected = re.escape(
        f"Streaming.agenerate, .astream_generate and .ajudge must give text, got {wrong!r}"
    )
    with pytest.raises(TypeError, match=expected):
        "".join(engine.query("What does the while statement do?").response_gen)

    async def read() -> str:
        response = await engine.aquery("What does the while statement do?")
        return "".join([piece async for piece in response.async_response_gen()])

    with pytest.raises(TypeError, match=expected):
        asyncio.run(read())


@pytest.mark.parametrize("kind", ["plain_generator", "coroutine"])
def test_a_critic_whose_astream_generate_is_no_async_generator_is_named(kind):
    # A plain ``def`` with ``yield`` used to fail inside the sync bridge with AttributeError:
    # 'generator' object has no attribute '__anext__' (async: "'async for' requires ...").
    class Streaming(Recording):
        if kind == "plain_generator":

            def astream_generate(self, query):
                yield "an answer"
        else:

            async def astream_generate(self, query):
                return "an answer"

    engine = SelfRAGQueryEngine(
        retriever=FixedRetriever(), critic=Streaming(), mode="no_retrieval", streaming=True
    )
    got = "generator" if kind == "plain_generator" else "coroutine"
    expected = re.escape(
        f"Streaming.astream_generate must be an async generator (async def with yield), got {got}"
    )
    with pytest.raises(TypeError, match=expected):
        "".join(engine.query("What does the while statement do?").response_gen)
    with pytest.raises(TypeError, match=expected):
        list(Streaming().stream_generate("q"))

    async def read() -> str:
        response = await engine.aquery("What does the while statement do?")
        return "".join([piece async for piece in response.async_response_gen()])

    with pytest.raises(TypeError, match=expected):
        asyncio.run(read())


@pytest.mark.parametrize(
    ("generate_kwargs", "message"),
    [
        ({"max_tokens": None}, "max_new_tokens"),
        ({"max_tokens": 2.5}, "max_new_tokens"),
        ({"max_tokens": "many"}, "max_new_tokens"),
        ({"max_tokens": 0}, "max_new_tokens must be at least 1"),
    ],
)
def test_generate_kwargs_that_are_no_answer_length_are_named(generate_kwargs, message):
    # max_tokens=None used to fail with "int() argument must be ... not 'NoneType'" and 2.5 was
    # cut to 2 without a word; now each is checked as max_new_tokens is.
    with pytest.raises(ValueError, match=message):
        SelfRAGQueryEngine(
            retriever=FixedRetriever(), critic=Recording(), generate_kwargs=generate_kwargs
        )


@pytest.mark.parametrize("temperature", [None, 0, 0.0, 0.7, "hot"])
def test_a_temperature_in_generate_kwargs_is_ignored_with_a_warning(temperature, caplog):
    # temperature=None and "hot" used to fail inside float(); greedy decoding ignores any.
    with caplog.at_level("WARNING"):
        engine = SelfRAGQueryEngine(
            retriever=FixedRetriever(),
            critic=Recording(),
            generate_kwargs={"temperature": temperature, "max_tokens": 9},
        )
    assert engine.max_new_tokens == 9
    warned = any("ignoring {'temperature'" in r.getMessage() for r in caplog.records)
    assert warned == (temperature not in (None, 0))


def test_generate_kwargs_the_engine_cannot_use_are_named_not_dropped(caplog):
    # generate_kwargs={"max_new_tokens": 200} (the engine's own name) was dropped without a
    # word, answers cut at 50 tokens; stops and penalties too.
    with caplog.at_level("WARNING"):
        engine = SelfRAGQueryEngine(
            retriever=FixedRetriever(),
            critic=Recording(),
            generate_kwargs={"max_new_tokens": 200, "stop": ["\n"], "top_p": 0.9},
        )
    assert engine.max_new_tokens == 200
    (message,) = [r.getMessage() for r in caplog.records if "ignoring" in r.getMessage()]
    assert "'stop'" in message and "'top_p'" in message and "max_new_tokens" not in message


def test_model_options_that_would_not_reach_a_model_are_refused(tiny_llm, request):
    # model_kwargs with llm= (the model is already loaded) and generator_llm= with a built
    # critic were ignored: the engine ran with the loaded model's context, or without the
    # generator asked for.
    with pytest.raises(ValueError, match=r"model_kwargs= applies to the model loaded from"):
        SelfRAGQueryEngine(llm=tiny_llm, retriever=FixedRetriever(), model_kwargs={"n_ctx": 64})
    with pytest.raises(ValueError, match=r"a built critic or llm=/model_path=/generator_llm="):
        SelfRAGQueryEngine(retriever=FixedRetriever(), critic=Recording(), generator_llm=tiny_llm)
    # max_new_tokens= with a built critic: the engine said 3, the critic wrote its own 50.
    critic = ReflectionCritic(tiny_llm, max_new_tokens=50)
    request.addfinalizer(critic.close)
    for options in ({"max_new_tokens": 3}, {"generate_kwargs": {"max_tokens": 3}}):
        with pytest.raises(ValueError, match=r"the critic passed writes 50 tokens: set it there"):
            SelfRAGQueryEngine(retriever=FixedRetriever(), critic=critic, **options)
    SelfRAGQueryEngine(retriever=FixedRetriever(), critic=critic, max_new_tokens=50)  # the same


@pytest.mark.parametrize("long_form", [False, True])
def test_a_paragraph_with_a_lone_surrogate_is_read_with_a_replacement_character(
    make_engine, long_form_llm, long_form
):
    # Text read with errors="surrogateescape" holds lone surrogates, which no model's tokenizer
    # can encode: the query used to fail with UnicodeEncodeError ('utf-8' codec can't encode
    # character '\ud800': surrogates not allowed) from inside the critic.
    nodes = [*make_nodes(), NodeWithScore(node=TextNode(text="caf\udce9 while \ud800"), score=0.5)]
    seen: list[str] = []
    options: dict[str, Any] = {"retriever": FixedRetriever(nodes)}
    if long_form:
        options |= {"llm": long_form_llm, "long_form": True, "max_segments": 1}
    engine = make_engine(**options)
    critic = engine.critic
    judge = critic.ajudge
    write = critic.awrite_segments

    async def recording(query, paragraphs):
        seen.extend(paragraphs)
        return await judge(query, paragraphs)

    async def recording_segments(branches, boundary_threshold):
        seen.extend(paragraph for _, paragraph in branches)
        return await write(branches, boundary_threshold)

    critic.ajudge = recording  # type: ignore[method-assign]
    critic.awrite_segments = recording_segments  # type: ignore[method-assign]
    response = engine.query("What does the while statement do?")
    assert str(response).strip()
    assert response.source_nodes  # the nodes themselves are returned as they came
    # Short form judges the paragraph; long form continues a path from it.
    assert "caf\ufffd while \ufffd" in seen
    assert not any("\ud800" in paragraph or "\udce9" in paragraph for paragraph in seen)
