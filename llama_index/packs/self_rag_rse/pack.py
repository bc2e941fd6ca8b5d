"""``SelfRAGPack``: the LlamaPack wrapper, importable on cores with or without ``llama_pack``."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine

try:  # llama-index-core <= 0.14.20 ships the pack base class; 0.14.21 removed it.
    from llama_index.core.llama_pack.base import BaseLlamaPack
except ImportError:

    class BaseLlamaPack(ABC):  # type: ignore[no-redef]
        """Stand-in for the removed ``llama_index.core.llama_pack.base.BaseLlamaPack``."""

        @abstractmethod
        def get_modules(self) -> dict[str, Any]:
            """Return the pack's modules."""

        @abstractmethod
        def run(self, *args: Any, **kwargs: Any) -> Any:
            """Run the pack."""


class SelfRAGPack(BaseLlamaPack):
    """Self-RAG as a LlamaPack: builds a :class:`SelfRAGQueryEngine` and queries it.

    Unlike the upstream pack, extra keyword arguments reach the engine (``llm=``, ``threshold=``,
    ``node_postprocessors=``, ...). The pack owns the engine it builds: :meth:`close` (or a
    ``with`` block) frees the model the engine loaded from ``model_path`` and leaves an ``llm=``
    it was given open::

        with SelfRAGPack(model_path="selfrag_llama2_7b.q4_k_m.gguf", retriever=retriever) as pack:
            print(pack.run("How do descriptors work?"))
    """

    def __init__(
        self,
        model_path: str | None = None,
        retriever: Any = None,
        verbose: bool = False,
        **kwargs: Any,
    ) -> None:
        self.query_engine = SelfRAGQueryEngine(
            model_path=model_path, retriever=retriever, verbose=verbose, **kwargs
        )
        self.retriever = retriever
        self.verbose = verbose

    def get_modules(self) -> dict[str, Any]:
        """The engine, its retriever and its critic."""
        return {
            "query_engine": self.query_engine,
            "retriever": self.retriever,
            "critic": self.query_engine.critic,
        }

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Query the engine: ``pack.run("question")``."""
        return self.query_engine.query(*args, **kwargs)

    def close(self) -> None:
        """Close the engine the pack built (the critic and the model it loaded; see
        :meth:`SelfRAGQueryEngine.close`). Safe to call twice.
        """
        self.query_engine.close()

    def __enter__(self) -> SelfRAGPack:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
