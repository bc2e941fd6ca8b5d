"""The five engines compared out of the box, built on one index and one LLM.

Same retriever settings, same LLM, so the differences are the techniques':

============================  ==========================================================
``top-k``                     core ``RetrieverQueryEngine``: the top chunks, one answer
``top-k+rse``                 the same with ``RelevantSegmentPostprocessor`` (segments)
``self-rag``                  ``SelfRAGQueryEngine`` on the top chunks
``self-rag+rse``              ``SelfRAGQueryEngine`` judging RSE segments
``self-rag+corrective``       ``SelfRAGQueryEngine`` on the top chunks, ``corrective=True``
============================  ==========================================================
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from llama_index.core.base.base_query_engine import BaseQueryEngine

#: Engine names in report order, with what each one is.
ENGINE_DESCRIPTIONS = {
    "top-k": "RetrieverQueryEngine, top-k chunks",
    "top-k+rse": "RetrieverQueryEngine + RelevantSegmentPostprocessor",
    "self-rag": "SelfRAGQueryEngine on top-k chunks",
    "self-rag+rse": "SelfRAGQueryEngine on RSE segments",
    "self-rag+corrective": "SelfRAGQueryEngine on top-k chunks, corrective loop",
}
ENGINE_NAMES = tuple(ENGINE_DESCRIPTIONS)


def default_engines(
    index: Any,
    llm: Any,
    *,
    similarity_top_k: int = 8,
    engines: Sequence[str] | None = None,
    rse_options: Mapping[str, Any] | None = None,
    self_rag_options: Mapping[str, Any] | None = None,
) -> dict[str, BaseQueryEngine]:
    """Build the engines of :data:`ENGINE_NAMES` (or the subset ``engines``) on ``index``.

    Args:
        index: a ``VectorStoreIndex`` (any index with ``as_retriever``); RSE reads the chunks
            between hits from its docstore or vector store.
        llm: the answering LLM, shared by every engine (a ``LlamaCPP`` gives Self-RAG batched
            decoding with exact label probabilities; any LlamaIndex LLM works).
        similarity_top_k: chunks retrieved by every engine.
        engines: names to build, in this order (default: all five).
        rse_options: ``RelevantSegmentPostprocessor`` options (``preset``, ``max_length``,
            ``overall_max_length``, ...). Small models need short segments, e.g.
            ``{"max_length": 6, "overall_max_length": 12}``.
        self_rag_options: ``SelfRAGQueryEngine`` options for the three Self-RAG engines
            (``ndocs``, ``max_new_tokens``, ``mode``, ``threshold``, ``critic``, ...);
            ``corrective`` is set per engine.

    Self-RAG engines own the critic they build: call ``close()`` on them when done (the LLM
    stays open). Unknown engine names and options raise.
    """
    from llama_index.core.query_engine import RetrieverQueryEngine

    from llama_index.packs.self_rag_rse.rse.postprocessor import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine

    names = list(engines) if engines is not None else list(ENGINE_NAMES)
    unknown = [n for n in names if n not in ENGINE_DESCRIPTIONS]
    if unknown:
        raise ValueError(f"unknown engine(s) {unknown}; choose from {list(ENGINE_NAMES)}")
    if similarity_top_k < 1:
        raise ValueError(f"similarity_top_k must be at least 1, got {similarity_top_k}")
    self_rag = dict(self_rag_options or {})
    if "corrective" in self_rag:
        raise ValueError("self_rag_options must not set corrective: it is set per engine")
    critic = self_rag.pop("critic", "auto")

    def rse() -> RelevantSegmentPostprocessor:
        return RelevantSegmentPostprocessor(index=index, **dict(rse_options or {}))

    def retriever() -> Any:
        return index.as_retriever(similarity_top_k=similarity_top_k)

    def selfrag(postprocessors: list[Any], corrective: bool) -> SelfRAGQueryEngine:
        return SelfRAGQueryEngine.from_args(
            retriever(),
            llm,
            critic=critic,
            node_postprocessors=postprocessors,
            corrective=corrective,
            **self_rag,
        )

    built: dict[str, BaseQueryEngine] = {}
    try:
        for name in names:
            if name == "top-k":
                built[name] = RetrieverQueryEngine.from_args(retriever(), llm=llm)
            elif name == "top-k+rse":
                built[name] = RetrieverQueryEngine.from_args(
                    retriever(), llm=llm, node_postprocessors=[rse()]
                )
            elif name == "self-rag":
                built[name] = selfrag([], corrective=False)
            elif name == "self-rag+rse":
                built[name] = selfrag([rse()], corrective=False)
            else:
                built[name] = selfrag([], corrective=True)
    except BaseException:
        close_engines(built)
        raise
    return built


def close_engines(engines: Mapping[str, Any]) -> None:
    """Close every engine that has ``close()`` (Self-RAG engines free their critics)."""
    for engine in engines.values():
        close = getattr(engine, "close", None)
        if callable(close):
            close()
