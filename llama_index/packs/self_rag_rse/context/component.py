"""What the two LLM-backed ingestion components share: a cache of LLM results, and the cost of
their last run."""

from __future__ import annotations

from llama_index.core.bridge.pydantic import PrivateAttr
from llama_index.core.schema import TransformComponent

from llama_index.packs.self_rag_rse.context.cache import ContextCache
from llama_index.packs.self_rag_rse.context.usage import ContextUsage


class ContextComponent(TransformComponent):
    """Base of :class:`~.headers.ContextualHeaders` and :class:`~.sectioner.DocumentSectioner`."""

    _cache: ContextCache = PrivateAttr()
    _usage: ContextUsage = PrivateAttr(default_factory=ContextUsage)

    @property
    def usage(self) -> ContextUsage:
        """What the last call cost (documents, LLM calls, cache hits, rejected windows)."""
        return self._usage

    @property
    def cache(self) -> ContextCache:
        """The per-document cache of LLM results (titles, summaries, sectionings)."""
        return self._cache
