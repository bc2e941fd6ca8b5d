"""Self-RAG (Asai et al. 2023) as a LlamaIndex query engine.

Per query: ask the critic whether to retrieve; if so, retrieve (and post-process, e.g. into RSE
segments), let the critic answer from every paragraph at once and score each answer (IsREL,
IsSUP, IsUSE, optional sequence score), and return the best paragraph's answer with the original
nodes as sources, best first. The optional corrective loop re-retrieves with a pseudo-document
or a rewritten query when nothing relevant came back, and regenerates unsupported answers.

The engine takes built parts (a retriever and a :class:`~.contract.BaseCritic`); the upstream
constructor ``SelfRAGQueryEngine(model_path, retriever)`` and :meth:`SelfRAGQueryEngine.from_args`
build the critic through :mod:`.factory`. The flow (the gate, then :mod:`.short_form` or
:mod:`.long_form` over :class:`~.flow.FlowParts`) is written once, async: ``query`` runs it
through the package's sync/async bridge, as the critics' blocking methods do, so ``query`` and
``aquery`` cannot drift apart and ``query`` works inside a running event loop too.
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any, Literal

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.postprocessor.types import BaseNodePostprocessor
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import QueryBundle, QueryType

from llama_index.packs.self_rag_rse.common.bridge import run_sync
from llama_index.packs.self_rag_rse.common.options import (
    pydantic_fields,
    reject_unknown,
    require_finite,
)
from llama_index.packs.self_rag_rse.common.streams import astripped, stripped
from llama_index.packs.self_rag_rse.critic.contract import BaseCritic, ParagraphJudgement
from llama_index.packs.self_rag_rse.critic.prompts import (
    ENGINE_PROMPT_VARIABLES,
    ENGINE_PROMPTS,
    as_template,
)
from llama_index.packs.self_rag_rse.self_rag.factory import build_critic
from llama_index.packs.self_rag_rse.self_rag.flow import FlowParts, Outcome, check_query, query_meta
from llama_index.packs.self_rag_rse.self_rag.long_form import long_form, long_form_unsupported
from llama_index.packs.self_rag_rse.self_rag.retrieval import paragraph_text, retrieve
from llama_index.packs.self_rag_rse.self_rag.short_form import Corrective, short_form
from llama_index.packs.self_rag_rse.self_rag.trace import print_table

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)

Mode = Literal["adaptive_retrieval", "always_retrieve", "no_retrieval"]

#: The response when neither any paragraph nor the model alone produced text.
NO_ANSWER = "No answer could be generated for this question."
#: Metadata keys tried, in order, for a paragraph's title line.
DEFAULT_TITLE_KEYS = ("title", "document_title")
#: Options that must be finite numbers (``threshold`` may be None).
_NUMBERS = ["w_rel", "w_sup", "w_use", "threshold", "rewrite_threshold"]
_NUMBERS += ["support_threshold", "utility_threshold"]
#: The scale each threshold is read on: the gate, relevance and support are probabilities.
_SCALES = dict.fromkeys(["threshold", "rewrite_threshold", "support_threshold"], (0.0, 1.0))
_SCALES["utility_threshold"] = (-1.0, 1.0)  # IsUSE's
_COUNTS = ["max_new_tokens", "max_retrieval_rounds", "beam_width", "max_segments", "ndocs"]
#: Keyword arguments of the upstream constructor that are not pydantic fields.
_CONSTRUCTOR_ARGS = {"model_path", "model_kwargs", "generate_kwargs", "llm", "critic"}
_CONSTRUCTOR_ARGS |= {"generator_llm"}


class SelfRAGQueryEngine(CustomQueryEngine):
    """Self-RAG query engine: adaptive retrieval, per-paragraph answers, reflection scoring.

    Drop-in for ``llama-index-packs-self-rag``: ``SelfRAGQueryEngine(model_path, retriever)``
    loads a Self-RAG GGUF with llama.cpp (and closes it in :meth:`close`). Pass ``llm=`` instead
    to reuse a loaded model: a ``LlamaCPP`` or ``llama_cpp.Llama`` (reflection tokens read from
    its logits when its vocabulary has them) or any LlamaIndex LLM (judged with prompts).
    ``critic`` forces one: ``"reflection"``, ``"prompted"`` or a built
    :class:`~.contract.BaseCritic` (the engine then uses it as given and does not close it). With
    the prompted critic, ``generator_llm`` may write the answers while ``llm`` judges them.

    The final score of a paragraph's answer is ``[seq_score] + w_rel·IsREL + w_sup·IsSUP +
    w_use·IsUSE``; the best one is the response. ``long_form=True`` writes the answer segment by
    segment instead, each citing its passage (:mod:`.long_form`; Self-RAG models only). Options
    are checked at construction and on assignment (``engine.ndocs = 0`` raises); unknown ones
    raise ``TypeError``. docs/self-rag.md says where we differ from the upstream pack (probability
    gate, first grounding/utility position, original source nodes).

    Example::

        engine = SelfRAGQueryEngine.from_args(index.as_retriever(), llm=LlamaCPP(model_path=...))
        print(engine.query("How do descriptors work?"))
    """

    model_config = ConfigDict(validate_assignment=True)

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
    max_regenerations: int = Field(default=1, ge=0, description="Regenerations of the best answer.")
    title_key: str | list[str] | None = Field(
        default=list(DEFAULT_TITLE_KEYS),
        description=(
            "Node metadata key(s) whose value becomes the paragraph's first line (the first "
            "non-empty one wins); None: no title line."
        ),
    )
    streaming: bool = Field(
        default=False,
        description=(
            "query returns a StreamingResponse, aquery an AsyncStreamingResponse, with its "
            "sources and metadata complete. The model's own answer (no retrieval) streams "
            "token by token; an answer chosen among paragraphs, or a long-form answer (one "
            "piece per segment), is known once the search ends, before the response is returned."
        ),
    )
    long_form: bool = Field(
        default=False,
        description=(
            "Write the answer segment by segment, each citing its passage (beam search over "
            "per-passage continuations; needs a Self-RAG model). max_new_tokens is per segment."
        ),
    )
    beam_width: int = Field(default=2, description="Long form: paths kept at each depth.")
    max_segments: int = Field(default=6, description="Long form: most segments per answer.")
    segment_retrieval: Literal["per_segment", "once"] = Field(
        default="per_segment",
        description=(
            "Long form: retrieve again for each path with the query and its last segment "
            "(per_segment), or use the query's passages at every depth (once)."
        ),
    )
    verbose: bool = Field(default=False, description="Print a per-paragraph table and the trace.")

    _critic: Any = PrivateAttr(default=None)
    _owns_critic: bool = PrivateAttr(default=False)
    _owned_model: Any = PrivateAttr(default=None)
    _prompts: dict[str, BasePromptTemplate] = PrivateAttr(default_factory=dict)

    def __init__(
        self,
        model_path: str | None = None,
        retriever: BaseRetriever | None = None,
        verbose: bool = False,
        model_kwargs: dict[str, Any] | None = None,
        generate_kwargs: dict[str, Any] | None = None,
        *,
        llm: Any = None,
        critic: str | BaseCritic = "auto",
        generator_llm: Any = None,
        **options: Any,
    ) -> None:
        reject_unknown(
            "SelfRAGQueryEngine", options, pydantic_fields(type(self)) | _CONSTRUCTOR_ARGS
        )
        if retriever is None:
            raise ValueError(
                "SelfRAGQueryEngine needs a retriever: pass retriever=index.as_retriever()"
            )
        generate_kwargs = dict(generate_kwargs or {})
        for key in ("max_tokens", "max_new_tokens"):  # llama_cpp's name, and the engine's
            if key in generate_kwargs and "max_new_tokens" not in options:
                options["max_new_tokens"] = generate_kwargs.pop(key)  # checked as a field
        own = getattr(critic, "max_new_tokens", None)  # a critic passed built has its own
        if own is not None and options.get("max_new_tokens", own) != own:
            raise ValueError(f"max_new_tokens: the critic passed writes {own} tokens: set it there")
        if generate_kwargs.get("temperature", 0) in (None, 0):
            generate_kwargs.pop("temperature", None)
        if generate_kwargs:  # sampling, stops, penalties: Self-RAG scores its greedy decodes
            logger.warning("Self-RAG scores greedy decodes; ignoring %s", generate_kwargs)
        super().__init__(retriever=retriever, verbose=verbose, **options)  # type: ignore[call-arg]
        built = build_critic(
            critic,
            llm=llm,
            model_path=model_path,
            model_kwargs=model_kwargs,
            generator_llm=generator_llm,
            max_new_tokens=self.max_new_tokens,
        )
        self._critic = built.critic
        self._owns_critic = isinstance(critic, str)
        self._owned_model = built.loaded_model
        if self.long_form and not self._critic.writes_segments:
            self.close()
            raise ValueError(long_form_unsupported(self._critic.name))
        self._prompts = dict(ENGINE_PROMPTS)
        logger.info("Self-RAG critic: %s", self._critic.name)
        if self.verbose:
            print(f"Self-RAG critic: {self._critic.name}")

    # -- option checks (at construction and on assignment) -----------------------------------
    @field_validator(*_NUMBERS)
    @classmethod
    def _finite(cls, value: float | None, info: ValidationInfo) -> float | None:
        require_finite("SelfRAGQueryEngine", **{str(info.field_name): value})
        low, high = _SCALES.get(str(info.field_name), (-math.inf, math.inf))
        if value is not None and not low <= value <= high:
            scale = f"[{low:g}, {high:g}], the scale it is read on"
            raise ValueError(f"{info.field_name} must be in {scale}, got {value}")
        return value

    @field_validator(*_NUMBERS, *_COUNTS, "max_regenerations", mode="before")
    @classmethod
    def _not_a_bool(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool):  # pydantic would read True as 1
            raise ValueError(f"{info.field_name} must be a number, got {value}")
        return value

    @field_validator(*_COUNTS)
    @classmethod
    def _at_least_one(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            none = " or None" if info.field_name == "ndocs" else ""
            raise ValueError(f"{info.field_name} must be at least 1{none}, got {value}")
        return value

    @field_validator("node_postprocessors", mode="before")
    @classmethod
    def _no_postprocessors(cls, value: Any) -> Any:
        return [] if value is None else value  # None: none, as core's query engines read it

    @field_validator("retriever")
    @classmethod
    def _retriever(cls, value: Any) -> Any:
        if not callable(getattr(value, "retrieve", None)):
            raise TypeError(
                f"retriever must be a LlamaIndex retriever (with retrieve()), got "
                f"{type(value).__name__}: pass e.g. retriever=index.as_retriever()"
            )
        return value

    @model_validator(mode="after")
    def _long_form_options(self) -> SelfRAGQueryEngine:
        if self.long_form and self.corrective:
            raise ValueError(
                "long_form=True and corrective=True cannot be combined: the corrective loop "
                "re-retrieves and regenerates short-form answers; long form retrieves per "
                "segment (segment_retrieval='per_segment')"
            )
        if self.long_form and self._critic is not None and not self._critic.writes_segments:
            raise ValueError(long_form_unsupported(self._critic.name))
        return self

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            return super().__setattr__(name, value)
        # A misspelt option is an error, as in the constructor.
        reject_unknown("SelfRAGQueryEngine", [name], pydantic_fields(type(self)))
        before = self.__dict__.get(name)
        try:
            super().__setattr__(name, value)
            if name == "max_new_tokens" and value != before:
                raise ValueError(
                    "max_new_tokens is read once, when the critic is built: pass "
                    f"SelfRAGQueryEngine(max_new_tokens={value!r}, ...) to a new engine"
                )
        except ValueError:
            # pydantic has already set the field when a check of the whole engine fails.
            self.__dict__[name] = before
            raise

    @classmethod
    def from_args(
        cls,
        retriever: BaseRetriever,
        llm: Any = None,
        *,
        model_path: str | None = None,
        model_kwargs: dict[str, Any] | None = None,
        critic: str | BaseCritic = "auto",
        generator_llm: Any = None,
        **options: Any,
    ) -> SelfRAGQueryEngine:
        """Build the engine from a retriever and a model (``llm=`` or ``model_path=``).

        ``options`` are the engine's fields (``threshold``, ``w_rel``, ``corrective``, ...).
        """
        return cls(
            model_path, retriever, model_kwargs=model_kwargs, llm=llm, critic=critic,
            generator_llm=generator_llm, **options,
        )  # fmt: skip

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SelfRAGQueryEngine"

    @property
    def critic(self) -> BaseCritic:
        """The critic in use (``critic.name`` says which)."""
        return self._critic

    def close(self) -> None:
        """Free the critic the engine built and the model it loaded (``model_path=``); a critic
        or model the caller passed in stays open: whoever created it closes it.
        """
        if self._owns_critic and self._critic is not None:
            self._critic.close()
        if self._owned_model is not None:
            self._owned_model.close()
            self._owned_model = None

    def __enter__(self) -> SelfRAGQueryEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- prompts ------------------------------------------------------------------------------
    def _get_prompts(self) -> PromptDictType:
        """The corrective loop's templates (the critic's are under ``critic:``)."""
        return dict(self._prompts)

    def _get_prompt_modules(self) -> PromptMixinType:
        """The critic, when it has prompts."""
        return {"critic": self._critic} if isinstance(self._critic, PromptMixin) else {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        for key, prompt in prompts_dict.items():
            if key in self._prompts:
                self._prompts[key] = as_template(prompt, key, ENGINE_PROMPT_VARIABLES)

    # -- LlamaIndex entry points (with the events CustomQueryEngine does not emit) ------------
    @dispatcher.span
    def query(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query."""
        check_query(str_or_query_bundle)
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        with self.callback_manager.as_trace("query"):  # as core's, with the bundle whole
            response = self.custom_query(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    @dispatcher.span
    async def aquery(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query without blocking the event loop."""
        check_query(str_or_query_bundle)
        dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
        with self.callback_manager.as_trace("query"):
            response = await self.acustom_query(str_or_query_bundle)
        dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=response))
        return response

    def custom_query(self, query_str: QueryType) -> Response | StreamingResponse:
        """Run Self-RAG for one query (blocking; safe inside a running event loop too)."""
        bundle = query_str if isinstance(query_str, QueryBundle) else QueryBundle(query_str)
        outcome = run_sync(self._run(bundle, blocking=True))
        final = functools.partial(self._final, meta=outcome.meta)
        meta = {"self_rag": outcome.meta}
        if self.streaming:
            pieces = outcome.stream()
            stream = self._critic.stream_generate(bundle.query_str) if pieces is None else pieces
            return StreamingResponse(stripped(stream, final), outcome.sources, meta)
        if outcome.answer is None:
            outcome.answer = self._critic.generate(bundle.query_str)
        return Response(final(outcome.answer), outcome.sources, meta)

    async def acustom_query(self, query_str: QueryType) -> Response | AsyncStreamingResponse:
        """Run Self-RAG for one query; model work runs off the event loop."""
        bundle = query_str if isinstance(query_str, QueryBundle) else QueryBundle(query_str)
        outcome = await self._run(bundle, blocking=False)
        final = functools.partial(self._final, meta=outcome.meta)
        meta = {"self_rag": outcome.meta}
        if self.streaming:
            stream = outcome.apieces(self._critic, bundle.query_str)
            return AsyncStreamingResponse(astripped(stream, final), outcome.sources, meta)
        if outcome.answer is None:
            outcome.answer = await self._critic.agenerate(bundle.query_str)
        return Response(final(outcome.answer), outcome.sources, meta)

    # -- the flow -----------------------------------------------------------------------------
    async def _run(self, bundle: QueryBundle, blocking: bool) -> Outcome:
        """The query's flow, the same for ``query`` and ``aquery``: the gate, then the short
        or the long form; sources and metadata are complete when it returns. ``blocking``
        (``query``): retrieve with the blocking methods (see :func:`~.retrieval.retrieve`).
        """
        meta = query_meta(self._critic.name, self.long_form)
        outcome = await self._flow(bundle, meta, blocking)
        if self.verbose:
            print_table(meta)
        return outcome

    async def _flow(self, bundle: QueryBundle, meta: dict[str, Any], blocking: bool) -> Outcome:
        query = bundle.query_str
        if self.mode == "no_retrieval":
            meta["trace"].append({"step": "generate", "reason": "mode=no_retrieval"})
            return Outcome(None, [], meta)
        if self.mode == "adaptive_retrieval":
            gate = await self._critic.adecide_retrieval(query, self.threshold, not self.streaming)
            if not hasattr(gate, "retrieve"):
                critic = type(self._critic).__name__
                raise TypeError(f"{critic}.adecide_retrieval must return a RetrievalDecision, "
                                f"got {gate!r:.80}")  # fmt: skip
            meta["retrieve_prob"] = gate.probability
            meta["trace"].append(
                dict(step="decide", retrieve=gate.retrieve, probability=gate.probability)
            )
            if not gate.retrieve:
                return Outcome(gate.answer, [], meta)
        parts = FlowParts(
            critic=self._critic,
            retrieve=functools.partial(
                retrieve, self.retriever, self.node_postprocessors, blocking=blocking, bundle=bundle
            ),
            score=self._score,
            paragraph=functools.partial(paragraph_text, title_key=self.title_key),
            prompts=dict(self._prompts),
            ndocs=self.ndocs,
            trace=meta["trace"],
        )
        if self.long_form:
            return await long_form(
                parts,
                query,
                meta,
                beam_width=self.beam_width,
                max_segments=self.max_segments,
                per_segment=self.segment_retrieval == "per_segment",
                # A generated [No Retrieval] ends a segment only where the critic's gate decides.
                boundary_threshold=self.threshold if self.mode == "adaptive_retrieval" else None,
            )
        knobs = {name: getattr(self, name) for name in Corrective.__dataclass_fields__}
        return await short_form(
            parts, query, meta, Corrective(**knobs) if self.corrective else None
        )

    def _score(self, judgement: ParagraphJudgement) -> float:
        if judgement.error is None:
            score = judgement.score(self.w_rel, self.w_sup, self.w_use, self.use_seqscore)
            if score == score:  # not NaN, which would win or lose a max() by its place
                return score
            judgement.error = (
                "its score is NaN: the critic read log-probabilities that are not numbers (a "
                "damaged model file or a numeric overflow); ranked last"
            )
        return float("-inf")

    def _final(self, answer: str, meta: dict[str, Any]) -> str:
        """The response text: never empty (an empty answer says so, in the text and the trace)."""
        if not isinstance(answer, str):
            raise TypeError(f"{type(self._critic).__name__}.agenerate, .astream_generate and "
                            f".ajudge must give text, got {answer!r:.80}")  # fmt: skip
        answer = answer.strip()
        if not answer:
            meta["trace"].append({"step": "no_answer", "reason": "the model generated no text"})
            return NO_ANSWER
        return answer
