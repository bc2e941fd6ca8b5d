"""Self-RAG (Asai et al. 2023) as a LlamaIndex query engine: construction, entry points, the gate.

Per query: ask the critic whether to retrieve; if so, retrieve (and post-process, e.g. into RSE
segments), let the critic answer from every paragraph at once and score each answer (IsREL,
IsSUP, IsUSE, optional sequence score), and return the best paragraph's answer with the original
nodes as sources, best first. The flow (the gate, then :mod:`.short_form` or :mod:`.long_form`
over :class:`~.flow.FlowParts`) is written once, async: ``query`` runs it through the package's
sync/async bridge, so ``query`` and ``aquery`` cannot drift apart. Critics are built by
:mod:`.factory`, options checked by :mod:`.options`; every critic call goes through a
:class:`~.checked.CheckedCritic`, and what the query did goes into a :class:`~.record.QueryRecord`
(``metadata["self_rag"]``, the ``verbose=True`` tables, the instrumentation events).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from typing import Any

from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.response.schema import (
    RESPONSE_TYPE,
    AsyncStreamingResponse,
    Response,
    StreamingResponse,
)
from llama_index.core.bridge.pydantic import PrivateAttr, model_validator
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.events.query import QueryEndEvent, QueryStartEvent
from llama_index.core.prompts import BasePromptTemplate
from llama_index.core.prompts.mixin import PromptDictType, PromptMixin, PromptMixinType
from llama_index.core.query_engine import CustomQueryEngine
from llama_index.core.schema import QueryBundle, QueryType

from llama_index.packs.self_rag_rse.common import tracing
from llama_index.packs.self_rag_rse.common.bridge import iterate_sync, run_sync
from llama_index.packs.self_rag_rse.common.options import pydantic_fields, reject_unknown
from llama_index.packs.self_rag_rse.common.streams import astripped, stripped
from llama_index.packs.self_rag_rse.critic.checked import CheckedCritic
from llama_index.packs.self_rag_rse.critic.contract import BaseCritic
from llama_index.packs.self_rag_rse.critic.prompts import (
    ENGINE_PROMPT_VARIABLES,
    ENGINE_PROMPTS,
    as_template,
)
from llama_index.packs.self_rag_rse.self_rag.factory import build_critic
from llama_index.packs.self_rag_rse.self_rag.flow import (
    FlowParts,
    Outcome,
    check_query,
    final_text,
    query_bundle,
)
from llama_index.packs.self_rag_rse.self_rag.long_form import long_form, long_form_unsupported
from llama_index.packs.self_rag_rse.self_rag.options import (
    CONSTRUCTOR_ARGS,
    SelfRAGOptions,
    read_generate_kwargs,
)
from llama_index.packs.self_rag_rse.self_rag.record import Generate, QueryRecord
from llama_index.packs.self_rag_rse.self_rag.retrieval import paragraph_text, retrieve
from llama_index.packs.self_rag_rse.self_rag.short_form import short_form
from llama_index.packs.self_rag_rse.self_rag.trace import print_table

logger = logging.getLogger(__name__)
dispatcher = get_dispatcher(__name__)


class SelfRAGQueryEngine(SelfRAGOptions, CustomQueryEngine):
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
    (:class:`~.options.SelfRAGOptions`) are checked at construction and on assignment
    (``engine.ndocs = 0`` raises); unknown ones raise ``TypeError``. docs/self-rag.md says where
    we differ from the upstream pack (probability gate, first grounding/utility position,
    original source nodes).

    Example::

        engine = SelfRAGQueryEngine.from_args(index.as_retriever(), llm=LlamaCPP(model_path=...))
        print(engine.query("How do descriptors work?"))
    """

    _checked: Any = PrivateAttr(default=None)
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
        reject_unknown(type(self).__name__, options, pydantic_fields(type(self)) | CONSTRUCTOR_ARGS)
        if retriever is None:
            raise ValueError(
                f"{type(self).__name__} needs a retriever: pass retriever=index.as_retriever()"
            )
        read_generate_kwargs(generate_kwargs, options, critic)
        super().__init__(retriever=retriever, verbose=verbose, **options)  # type: ignore[call-arg]
        built, loaded = build_critic(
            critic,
            llm=llm,
            model_path=model_path,
            model_kwargs=model_kwargs,
            generator_llm=generator_llm,
            max_new_tokens=self.max_new_tokens,
        )
        self._checked = CheckedCritic(built)
        self._owns_critic = isinstance(critic, str)
        self._owned_model = loaded
        if self.long_form and not self.critic.writes_segments:
            self.close()
            raise ValueError(long_form_unsupported(self.critic.name))
        self._prompts = dict(ENGINE_PROMPTS)
        logger.info("Self-RAG critic: %s", self.critic.name)
        if self.verbose:
            print(f"Self-RAG critic: {self.critic.name}")

    @model_validator(mode="after")
    def _critic_writes_segments(self) -> SelfRAGQueryEngine:
        # On assignment (engine.long_form = True): the critic is built by then.
        no_segments = self._checked is not None and not self.critic.writes_segments
        if self.long_form and no_segments:
            raise ValueError(long_form_unsupported(self.critic.name))
        return self

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

        ``model_kwargs`` are the settings of the model loaded from ``model_path``; ``critic``
        and ``generator_llm`` are the constructor's; ``options`` are the engine's fields
        (``threshold``, ``w_rel``, ``corrective``, ...).
        """
        return cls(
            model_path,
            retriever,
            model_kwargs=model_kwargs,
            llm=llm,
            critic=critic,
            generator_llm=generator_llm,
            **options,
        )

    @classmethod
    def class_name(cls) -> str:
        """Name used in serialisation."""
        return "SelfRAGQueryEngine"

    @property
    def critic(self) -> BaseCritic:
        """The critic in use, as it was passed or built (``critic.name`` says which)."""
        return self._checked.critic

    def close(self) -> None:
        """Free the critic the engine built and the model it loaded (``model_path=``); a critic or
        model the caller passed in stays open: whoever created it closes it.
        """
        if self._owns_critic and self._checked is not None:
            self.critic.close()
        if self._owned_model is not None:
            self._owned_model.close()
            self._owned_model = None

    def __enter__(self) -> SelfRAGQueryEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        """Refuse pickling with the fix: a loaded model cannot cross processes."""
        raise TypeError(
            "SelfRAGQueryEngine cannot be pickled: it holds a loaded model (the critic's "
            "llama.cpp context and worker thread, or its server connections), which cannot be "
            "sent to another process; build the engine in each process (e.g. in the worker's "
            "initializer)"
        )

    # -- prompts ------------------------------------------------------------------------------
    def _get_prompts(self) -> PromptDictType:
        """The corrective loop's templates (the critic's are under ``critic:``)."""
        return dict(self._prompts)

    def _get_prompt_modules(self) -> PromptMixinType:
        """The critic, when it has prompts."""
        return {"critic": self.critic} if isinstance(self.critic, PromptMixin) else {}

    def _update_prompts(self, prompts_dict: PromptDictType) -> None:
        for key, prompt in prompts_dict.items():
            if key in self._prompts:
                self._prompts[key] = as_template(prompt, key, ENGINE_PROMPT_VARIABLES)

    # -- LlamaIndex entry points (with the events CustomQueryEngine does not emit) ------------
    # The query's span is opened by hand: a streamed answer's ends with its stream, not at return.
    @tracing.opens_own_span
    def query(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query."""
        with self._query_span("SelfRAGQueryEngine.query", str_or_query_bundle) as span:
            span.result = self._answer(query_bundle(str_or_query_bundle), span)
        return span.result

    @tracing.opens_own_span
    async def aquery(self, str_or_query_bundle: QueryType) -> RESPONSE_TYPE:
        """Answer a query without blocking the event loop."""
        with self._query_span("SelfRAGQueryEngine.aquery", str_or_query_bundle) as span:
            span.result = await self._aanswer(query_bundle(str_or_query_bundle), span)
        return span.result

    @contextlib.contextmanager
    def _query_span(self, name: str, str_or_query_bundle: QueryType) -> Iterator[tracing.Span]:
        """The query checked, then its span and core's query events around the block."""
        check_query(str_or_query_bundle)
        with tracing.span(name, str_or_query_bundle=str_or_query_bundle) as span:
            dispatcher.event(QueryStartEvent(query=str_or_query_bundle))
            # As core's engines do, with the bundle whole.
            with self.callback_manager.as_trace("query"):
                yield span
            dispatcher.event(QueryEndEvent(query=str_or_query_bundle, response=span.result))

    def custom_query(self, query_str: QueryType) -> Response | StreamingResponse:
        """Run Self-RAG for one query (blocking; safe inside a running event loop too)."""
        return self._answer(query_bundle(query_str), tracing.Span())

    async def acustom_query(self, query_str: QueryType) -> Response | AsyncStreamingResponse:
        """Run Self-RAG for one query; model work runs off the event loop."""
        return await self._aanswer(query_bundle(query_str), tracing.Span())

    def _answer(self, bundle: QueryBundle, span: tracing.Span) -> Response | StreamingResponse:
        """The blocking query's response; a streamed one takes over ``span``: the stream ends it."""
        if not self.streaming:
            return run_sync(self._respond(bundle, blocking=True))
        outcome = run_sync(self._run(bundle, blocking=True))
        pieces = tracing.traced(outcome.apieces(self._checked, bundle.query_str), span.hand_over())
        final = functools.partial(final_text, record=outcome.record)
        return StreamingResponse(
            stripped(iterate_sync(pieces), final),
            outcome.sources,
            {"self_rag": outcome.record.to_metadata()},
        )

    async def _aanswer(
        self, bundle: QueryBundle, span: tracing.Span
    ) -> Response | AsyncStreamingResponse:
        """:meth:`_answer` without blocking the event loop."""
        if not self.streaming:
            return await self._respond(bundle, blocking=False)
        outcome = await self._run(bundle, blocking=False)
        pieces = tracing.traced(outcome.apieces(self._checked, bundle.query_str), span.hand_over())
        final = functools.partial(final_text, record=outcome.record)
        return AsyncStreamingResponse(
            astripped(pieces, final), outcome.sources, {"self_rag": outcome.record.to_metadata()}
        )

    # -- the flow -----------------------------------------------------------------------------
    async def _respond(self, bundle: QueryBundle, blocking: bool) -> Response:
        """The query's response, not streamed: the flow's answer, else the model's own."""
        outcome = await self._run(bundle, blocking)
        answer = outcome.answer
        if answer is None:
            # The model answers alone (no retrieval, or a fallback): a step of its own in traces.
            with tracing.span("SelfRAG.generate", query=bundle.query_str) as span:
                answer = await self._checked.aanswer(bundle.query_str)
                span.result = answer
        text = final_text(answer, outcome.record)
        return Response(text, outcome.sources, {"self_rag": outcome.record.to_metadata()})

    async def _run(self, bundle: QueryBundle, blocking: bool) -> Outcome:
        """The gate, then the short or long form, for ``query`` and ``aquery`` alike (``blocking``:
        retrieve with the blocking methods, :func:`~.retrieval.retrieve`).
        """
        record = QueryRecord(critic=self.critic.name, long_form=self.long_form)
        outcome = await self._flow(bundle, record, blocking)
        if self.verbose:
            print_table(record)
        return outcome

    async def _flow(self, bundle: QueryBundle, record: QueryRecord, blocking: bool) -> Outcome:
        """The gate, then the form the options ask for."""
        query = bundle.query_str
        if self.mode == "no_retrieval":
            record.add(Generate())
            return Outcome(None, [], record)
        if self.mode == "adaptive_retrieval":
            with tracing.span("SelfRAG.gate", query=query, threshold=self.threshold) as span:
                # A streamed response streams the model's own answer: the gate need not write it.
                gate = await self._checked.adecide_retrieval(
                    query, self.threshold, answer_if_skipped=not self.streaming
                )
                record.decided(gate.retrieve, gate.probability)
                span.result = gate
            if not gate.retrieve:
                return Outcome(gate.answer, [], record)
        parts = FlowParts(
            critic=self._checked,
            retrieve=functools.partial(
                retrieve,
                self.retriever,
                self.node_postprocessors,
                blocking=blocking,
                bundle=bundle,
            ),
            score=self.final_score,
            paragraph=functools.partial(paragraph_text, title_key=self.title_key),
            prompts=dict(self._prompts),
            ndocs=self.ndocs,
            record=record,
        )
        if self.long_form:
            return await long_form(
                parts,
                query,
                beam_width=self.beam_width,
                max_segments=self.max_segments,
                per_segment=self.segment_retrieval == "per_segment",
                # A generated [No Retrieval] ends a segment only where the critic's gate decides.
                boundary_threshold=self.threshold if self.mode == "adaptive_retrieval" else None,
            )
        return await short_form(parts, query, self.corrective_loop())
