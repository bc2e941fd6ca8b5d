"""Self-RAG (Asai et al. 2023) as a LlamaIndex query engine.

Per query: ask the critic whether to retrieve; if so, retrieve (and post-process, e.g. into RSE
segments), let the critic answer from every paragraph at once and score each answer (IsREL,
IsSUP, IsUSE, optional sequence score), and return the best paragraph's answer with the original
nodes as sources, best first. The optional corrective loop re-retrieves with a pseudo-document
or a rewritten query when nothing relevant came back, and regenerates unsupported answers.

The control flow is written once, as a generator of steps; a sync and an async driver execute
the steps, so ``query`` and ``aquery`` cannot drift apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import RESPONSE_TYPE, Response
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import MetadataMode, NodeWithScore, QueryBundle, QueryType

from llama_index.packs.self_rag_rse.self_rag.contract import Critic, ParagraphJudgement, RetrievalDecision
from llama_index.packs.self_rag_rse.llamacpp.compat import llama_of

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

Mode = Literal["adaptive_retrieval", "always_retrieve", "no_retrieval"]

#: Model settings used when the engine loads a GGUF itself (``model_path``). Unlike the
#: upstream pack there is no ``logits_all``: the critic reads only the logits it needs.
DEFAULT_MODEL_KWARGS: dict[str, Any] = {"n_ctx": 2048, "n_gpu_layers": -1, "verbose": False}

QUERY2DOC_INSTRUCTION = (
    "Write a short encyclopedia-style passage that answers the question below. "
    "Answer with the passage only.\n\nQuestion: {query}"
)
REWRITE_INSTRUCTION = (
    "Rewrite the question below as a short search query that names its key terms. "
    "Answer with the query only.\n\nQuestion: {query}"
)
GROUNDED_INSTRUCTION = "{query}\n\nAnswer using only facts stated in the paragraph."
#: The response when neither any paragraph nor the model alone produced text.
NO_ANSWER = "No answer could be generated for this question."


@dataclass
class _Step:
    """One unit of work the drivers execute: ``kind`` is decide, retrieve, judge or generate."""

    kind: str
    text: str
    paragraphs: Sequence[str] = ()


@dataclass
class _Candidate:
    node: NodeWithScore
    judgement: ParagraphJudgement
    score: float


class SelfRAGQueryEngine(CustomQueryEngine):
    """Self-RAG query engine: adaptive retrieval, per-paragraph answers, reflection scoring.

    Drop-in for ``llama-index-packs-self-rag``: ``SelfRAGQueryEngine(model_path, retriever)``
    loads a Self-RAG GGUF with llama.cpp. Pass ``llm=`` instead to reuse a loaded model: a
    ``LlamaCPP`` or ``llama_cpp.Llama`` (reflection tokens read from its logits when its
    vocabulary has them) or any LlamaIndex LLM (judged with prompts). ``critic`` forces one:
    ``"reflection"``, ``"prompted"`` or a :class:`~.critic.Critic` instance. With the prompted
    critic, ``generator_llm`` may write the answers while ``llm`` judges them.

    The final score of a paragraph's answer is ``[seq_score] + w_rel·IsREL + w_sup·IsSUP +
    w_use·IsUSE``; the best one is the response. See the README for where we differ from the
    upstream pack (probability gate, first grounding/utility position, original source nodes).
    """

    retriever: Any = Field(description="Any LlamaIndex retriever.")
    mode: Mode = Field(
        default="adaptive_retrieval",
        description="adaptive_retrieval (the critic decides), always_retrieve or no_retrieval.",
    )
    threshold: float | None = Field(
        default=None,
        description=(
            "Retrieve when p([Retrieval]) / (p([Retrieval]) + p([No Retrieval])) > threshold; "
            "None lets the greedy output decide (as the upstream pack). Self-RAG uses 0.2 on PopQA."
        ),
    )
    w_rel: float = Field(default=1.0, description="Weight of IsREL (relevance, 0..1).")
    w_sup: float = Field(default=1.0, description="Weight of IsSUP (support, 0..1).")
    w_use: float = Field(default=0.5, description="Weight of IsUSE (utility, -1..1).")
    use_seqscore: bool = Field(
        default=False, description="Add exp(mean token log-prob) of the answer to its score."
    )
    ndocs: int | None = Field(
        default=10, description="At most this many paragraphs are judged (None: all)."
    )
    max_new_tokens: int = Field(default=50, description="Tokens generated per answer.")
    node_postprocessors: list[BaseNodePostprocessor] = Field(
        default_factory=list,
        description="Run on retrieved nodes before judging (e.g. RelevantSegmentPostprocessor).",
    )
    corrective: bool = Field(
        default=False, description="Turn on the corrective loop (re-retrieve, regenerate)."
    )
    rewrite_threshold: float = Field(
        default=0.5, description="Best relevance below this triggers query2doc, then a rewrite."
    )
    support_threshold: float = Field(
        default=0.5, description="The chosen answer's support below this triggers regeneration."
    )
    utility_threshold: float = Field(
        default=0.0, description="The chosen answer's utility below this triggers a rewrite."
    )
    max_retrieval_rounds: int = Field(default=3, description="Retrievals per query, all told.")
    max_regenerations: int = Field(default=1, description="Regenerations of the chosen answer.")
    verbose: bool = Field(default=False, description="Print a per-paragraph table and the trace.")

    _critic: Any = PrivateAttr(default=None)

    def __init__(
        self,
        model_path: str | None = None,
        retriever: BaseRetriever | None = None,
        verbose: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        *,
        llm: Any = None,
        critic: str | Critic = "auto",
        generator_llm: Any = None,
        **options: Any,
    ) -> None:
        if retriever is None:
            raise ValueError(
                "SelfRAGQueryEngine needs a retriever: pass retriever=index.as_retriever()"
            )
        generate_kwargs = dict(generate_kwargs or {})
        if "max_tokens" in generate_kwargs and "max_new_tokens" not in options:
            options["max_new_tokens"] = int(generate_kwargs.pop("max_tokens"))
        if float(generate_kwargs.get("temperature", 0.0)) != 0.0:
            logger.warning(
                "Self-RAG scores greedy decodes; ignoring temperature=%s",
                generate_kwargs["temperature"],
            )
        super().__init__(retriever=retriever, verbose=verbose, **options)  # type: ignore[call-arg]
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.ndocs is not None and self.ndocs < 1:
            raise ValueError(f"ndocs must be at least 1 or None, got {self.ndocs}")
        if self.max_retrieval_rounds < 1:
            raise ValueError("max_retrieval_rounds must be at least 1 (the first retrieval)")
        if self.threshold is not None and not 0.0 <= self.threshold <= 1.0:
            raise ValueError(
                f"threshold is a probability in [0, 1] (or None), got {self.threshold}"
            )
        self._critic = _build_critic(
            critic,
            llm,
            model_path,
            model_kwargs,
            max_new_tokens=self.max_new_tokens,
            generator_llm=generator_llm,
        )
        logger.info("Self-RAG critic: %s", self._critic.name)
        if self.verbose:
            print(f"Self-RAG critic: {self._critic.name}")

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SelfRAGQueryEngine"

    @property
    def critic(self) -> Critic:
        """The critic backend in use (``critic.name`` says which)."""
        return self._critic

    # -- LlamaIndex entry points (with the events CustomQueryEngine does not emit) ------------
    @dispatcher.span
    def query(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query."""
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        response = super().query(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    @dispatcher.span
    async def aquery(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query without blocking the event loop."""
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        response = await super().aquery(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    def custom_query(self, query_str: str) -> Response:
        """Run Self-RAG for one query (blocking)."""
        flow = self._flow(query_str)
        try:
            step = next(flow)
            while True:
                step = flow.send(self._run(step))
        except StopIteration as done:
            return done.value

    async def acustom_query(self, query_str: str) -> Response:
        """Run Self-RAG for one query; blocking model work runs in a worker thread."""
        flow = self._flow(query_str)
        try:
            step = next(flow)
            while True:
                step = flow.send(await self._arun(step))
        except StopIteration as done:
            return done.value

    # -- drivers ----------------------------------------------------------------------------
    def _run(self, step: _Step) -> Any:
        if step.kind == "decide":
            return self._critic.decide_retrieval(step.text, self.threshold)
        if step.kind == "retrieve":
            bundle = QueryBundle(step.text)
            nodes = self.retriever.retrieve(bundle)
            for post in self.node_postprocessors:
                nodes = post.postprocess_nodes(nodes, query_bundle=bundle)
            return nodes
        if step.kind == "judge":
            return self._critic.judge(step.text, list(step.paragraphs))
        return self._critic.generate(step.text)

    async def _arun(self, step: _Step) -> Any:
        if step.kind == "retrieve":
            bundle = QueryBundle(step.text)
            nodes = await self.retriever.aretrieve(bundle)
            for post in self.node_postprocessors:
                nodes = await post.apostprocess_nodes(nodes, query_bundle=bundle)
            return nodes
        native = {"decide": "adecide_retrieval", "judge": "ajudge", "generate": "agenerate"}
        method = getattr(self._critic, native[step.kind], None)
        if method is not None:
            if step.kind == "decide":
                return await method(step.text, self.threshold)
            if step.kind == "judge":
                return await method(step.text, list(step.paragraphs))
            return await method(step.text)
        return await asyncio.to_thread(self._run, step)

    # -- the algorithm ----------------------------------------------------------------------
    def _flow(self, query: str) -> Generator[_Step, Any, Response]:
        if not isinstance(query, str) or not query.strip():
            raise ValueError("query is empty: pass a non-empty question")
        trace: list[dict[str, Any]] = []
        meta: dict[str, Any] = {
            "critic": self._critic.name,
            "retrieve": False,
            "retrieve_prob": None,
            "best": None,
            "paragraphs": [],
            "trace": trace,
        }
        if self.mode == "no_retrieval":
            answer = yield _Step("generate", query)
            trace.append({"step": "generate", "reason": "mode=no_retrieval"})
            return self._respond(answer, [], meta)
        if self.mode == "adaptive_retrieval":
            decision: RetrievalDecision = yield _Step("decide", query)
            meta["retrieve_prob"] = decision.probability
            trace.append(
                {
                    "step": "decide",
                    "retrieve": decision.retrieve,
                    "probability": decision.probability,
                }
            )
            if not decision.retrieve:
                answer = decision.answer
                if answer is None:
                    answer = yield _Step("generate", query)
                return self._respond(answer, [], meta)

        candidates: list[_Candidate] = []
        seen: set[str] = set()
        rounds = 0
        search_query = query
        used_query2doc = False
        while True:
            rounds += 1
            nodes: list[NodeWithScore] = yield _Step("retrieve", search_query)
            fresh = [n for n in nodes if n.node.node_id not in seen]
            if self.ndocs is not None:
                fresh = fresh[: self.ndocs]
            trace.append(
                {"step": "retrieve", "round": rounds, "query": search_query, "nodes": len(fresh)}
            )
            if fresh:
                judgements = yield _Step("judge", query, [_paragraph(n) for n in fresh])
                for node, judgement in zip(fresh, judgements, strict=True):
                    seen.add(node.node.node_id)
                    candidates.append(_Candidate(node, judgement, self._score(judgement)))
            if not self.corrective or rounds >= self.max_retrieval_rounds:
                break
            best = _best(self._relevant(candidates))
            if best is None:
                reason = "no relevant paragraph"
            elif best.judgement.utility < self.utility_threshold:
                reason = "low utility"
            else:
                break
            if not used_query2doc and reason == "no relevant paragraph":
                used_query2doc = True
                search_query = yield _Step("generate", QUERY2DOC_INSTRUCTION.format(query=query))
                trace.append({"step": "query2doc", "reason": reason, "query": search_query})
            else:
                search_query = yield _Step("generate", REWRITE_INSTRUCTION.format(query=query))
                trace.append({"step": "rewrite", "reason": reason, "query": search_query})
            if not search_query.strip():
                search_query = query

        if self.corrective:
            # Keep only paragraphs that passed the relevance bar across rounds; if none did,
            # every round failed and the model answers alone.
            relevant = self._relevant(candidates)
            if candidates and not relevant:
                trace.append({"step": "fallback", "reason": "no relevant paragraph in any round"})
                answer = yield _Step("generate", query)
                meta["retrieve"] = True
                meta["paragraphs"] = [_paragraph_meta(c) for c in candidates]
                return self._respond(answer, candidates, meta, best=None)
            chosen = yield from self._ensure_support(query, relevant, trace)
        else:
            chosen = _best(candidates)

        meta["retrieve"] = bool(candidates)
        meta["paragraphs"] = [_paragraph_meta(c) for c in candidates]
        if chosen is None or not chosen.judgement.answer.strip():
            reason = "retriever returned no nodes" if not candidates else "no usable answer"
            trace.append({"step": "fallback", "reason": reason})
            answer = yield _Step("generate", query)
            return self._respond(answer, candidates, meta, best=None)
        return self._respond(chosen.judgement.answer, candidates, meta, best=chosen)

    def _ensure_support(
        self, query: str, candidates: list[_Candidate], trace: list[dict[str, Any]]
    ) -> Generator[_Step, Any, _Candidate | None]:
        """Regenerate an unsupported answer, then fall back to the next-best supported one."""
        ranked = sorted(
            (c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()),
            key=lambda c: -c.score,
        )
        if not ranked or ranked[0].judgement.support >= self.support_threshold:
            return ranked[0] if ranked else None
        best = ranked[0]
        for attempt in range(1, self.max_regenerations + 1):
            grounded = GROUNDED_INSTRUCTION.format(query=query)
            (redo,) = yield _Step("judge", grounded, [_paragraph(best.node)])
            trace.append(
                {
                    "step": "regenerate",
                    "attempt": attempt,
                    "support": redo.support,
                    "node_id": best.node.node_id,
                }
            )
            if (
                redo.error is None
                and redo.support >= self.support_threshold
                and redo.answer.strip()
            ):
                best.judgement = redo
                best.score = self._score(redo)
                return best
        for other in ranked[1:]:
            if other.judgement.support >= self.support_threshold:
                trace.append({"step": "next_best", "node_id": other.node.node.node_id})
                return other
        trace.append({"step": "keep_best", "reason": "no paragraph supports its answer"})
        return best

    def _relevant(self, candidates: list[_Candidate]) -> list[_Candidate]:
        """Paragraphs the corrective loop may answer from: relevance at the bar, no error."""
        return [
            c
            for c in candidates
            if c.judgement.error is None and c.judgement.relevance >= self.rewrite_threshold
        ]

    def _score(self, judgement: ParagraphJudgement) -> float:
        if judgement.error is not None:
            return float("-inf")
        return judgement.score(self.w_rel, self.w_sup, self.w_use, self.use_seqscore)

    def _respond(
        self,
        answer: str,
        candidates: list[_Candidate],
        meta: dict[str, Any],
        best: _Candidate | None = None,
    ) -> Response:
        answer = answer.strip()
        if not answer:
            # The model produced nothing usable even on its own: say so rather than return "".
            answer = NO_ANSWER
            meta["trace"].append({"step": "no_answer", "reason": "the model generated no text"})
        if best is not None:
            meta["best"] = next(i for i, c in enumerate(candidates) if c is best)
        if self.verbose:
            _print_table(candidates, meta)
        # Best first: the chosen paragraph, then the rest by score (an empty answer can outscore
        # the chosen one but cannot be the response).
        ranked = sorted(candidates, key=lambda c: (c is not best, -c.score))
        sources = [
            NodeWithScore(node=c.node.node, score=c.score if c.judgement.error is None else None)
            for c in ranked
        ]
        return Response(response=answer, source_nodes=sources, metadata={"self_rag": meta})


def _build_critic(
    critic: str | Critic,
    llm: Any,
    model_path: str | None,
    model_kwargs: dict[str, Any] | None,
    *,
    max_new_tokens: int,
    generator_llm: Any = None,
) -> Critic:
    if not isinstance(critic, str):
        return critic
    if critic not in ("auto", "reflection", "prompted"):
        raise ValueError(
            f"critic must be 'auto', 'reflection', 'prompted' or a Critic, got {critic!r}"
        )
    if llm is None and model_path is None:
        raise ValueError(
            "pass model_path= (a Self-RAG GGUF) or llm= (a LlamaCPP, llama_cpp.Llama or any "
            "LlamaIndex LLM)"
        )
    if llm is not None and model_path is not None:
        raise ValueError("pass model_path= or llm=, not both")
    if model_path is not None:
        llm = _load_gguf(model_path, model_kwargs)
    raw = llama_of(llm)
    if critic in ("auto", "reflection") and raw is not None and generator_llm is None:
        from llama_index.packs.self_rag_rse.self_rag.reflection_critic import ReflectionCritic

        try:
            return ReflectionCritic(raw, max_new_tokens=max_new_tokens)
        except ValueError:
            if critic == "reflection":
                raise
            logger.info("model has no reflection tokens: using the prompted critic")
    elif critic == "reflection":
        raise ValueError(
            "critic='reflection' needs a llama.cpp model with Self-RAG reflection tokens "
            "(model_path=, a LlamaCPP or a llama_cpp.Llama); use critic='prompted' for other LLMs"
        )
    from llama_index.packs.self_rag_rse.self_rag.prompted_critic import PromptedCritic

    return PromptedCritic(llm, generator_llm=generator_llm, max_new_tokens=max_new_tokens)


def _load_gguf(model_path: str, model_kwargs: dict[str, Any] | None) -> Any:
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError(
            "model_path needs llama-cpp-python: "
            'pip install "llama-index-packs-self-rag-rse[llama-cpp]"'
        ) from error
    kwargs = {**DEFAULT_MODEL_KWARGS, **(model_kwargs or {})}
    return llama_cpp.Llama(model_path=str(model_path), **kwargs)


def _paragraph(item: NodeWithScore) -> str:
    text = item.node.get_content(metadata_mode=MetadataMode.NONE)
    title = item.node.metadata.get("title")
    return f"{title}\n{text}" if title else text


def _best(candidates: list[_Candidate]) -> _Candidate | None:
    """Highest-scoring paragraph with an answer (an empty answer cannot be the response)."""
    usable = [c for c in candidates if c.judgement.error is None and c.judgement.answer.strip()]
    return max(usable, key=lambda c: c.score) if usable else None


def _paragraph_meta(c: _Candidate) -> dict[str, Any]:
    j = c.judgement
    row: dict[str, Any] = {
        "node_id": c.node.node.node_id,
        "answer": j.answer,
        "relevance": j.relevance,
        "support": j.support,
        "utility": j.utility,
        "seq_score": j.seq_score,
        "score": c.score if j.error is None else None,
    }
    if j.error is not None:
        row["error"] = j.error
    return row


def _print_table(candidates: list[_Candidate], meta: dict[str, Any]) -> None:
    prob = meta["retrieve_prob"]
    print(
        f"Self-RAG [{meta['critic']}] retrieve={meta['retrieve']}"
        + (f" p={prob:.3f}" if prob is not None else "")
    )
    if candidates:
        print(
            f"  {'#':>2} {'node':<10} {'rel':>5} {'sup':>5} {'use':>5} {'seq':>5} "
            f"{'score':>6}  answer"
        )
    for i, c in enumerate(candidates):
        j = c.judgement
        seq = f"{j.seq_score:.2f}" if j.seq_score is not None else "  -"
        mark = "*" if meta["best"] == i else " "
        answer = (j.error or j.answer).replace("\n", " ")[:60]
        print(
            f"{mark}{i:>2} {c.node.node.node_id[:10]:<10} {j.relevance:5.2f} {j.support:5.2f} "
            f"{j.utility:+5.2f} {seq:>5} {c.score:6.2f}  {answer}"
        )
    for entry in meta["trace"]:
        print("  trace:", entry)
