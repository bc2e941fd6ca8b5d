"""Self-RAG query engine and Relevant Segment Extraction for LlamaIndex.

The public names below are imported on first use, so ``import llama_index.packs.self_rag_rse``
stays cheap and optional dependencies (llama-cpp-python, matplotlib) load only when a component
that needs them is used. Internals stay importable from their modules.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports only show the lazy exports to type checkers

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:  # what type checkers and IDEs see of the names below
    from llama_index.packs.self_rag_rse.context.headers import ContextualHeaders
    from llama_index.packs.self_rag_rse.context.sectioner import DocumentSectioner
    from llama_index.packs.self_rag_rse.download import download_llama_pack
    from llama_index.packs.self_rag_rse.llamacpp.backend import LlamaCppBackend
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic
    from llama_index.packs.self_rag_rse.pack import SelfRAGPack
    from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY, ChunkIndexer
    from llama_index.packs.self_rag_rse.rse.plot import plot_segments
    from llama_index.packs.self_rag_rse.rse.postprocessor import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.rse.segments import find_best_segments
    from llama_index.packs.self_rag_rse.rse.types import SegmentExtraction
    from llama_index.packs.self_rag_rse.rse.values import PRESETS, get_preset
    from llama_index.packs.self_rag_rse.self_rag.backend import CriticBackend
    from llama_index.packs.self_rag_rse.self_rag.contract import (
        BaseCritic,
        ParagraphJudgement,
        RetrievalDecision,
    )
    from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.self_rag.prompted_critic import PromptedCritic
    from llama_index.packs.self_rag_rse.served.reflection_critic import ServedReflectionCritic

#: Public name -> module that defines it; ``__all__`` is this table's keys.
_EXPORTS = {
    "SelfRAGQueryEngine": "self_rag.engine",
    "SelfRAGPack": "pack",
    "RelevantSegmentPostprocessor": "rse.postprocessor",
    "SegmentExtraction": "rse.types",
    "ChunkIndexer": "rse.chunk_index",
    "DocumentSectioner": "context.sectioner",
    "ContextualHeaders": "context.headers",
    "CHUNK_INDEX_KEY": "rse.chunk_index",
    "BaseCritic": "self_rag.contract",
    "ParagraphJudgement": "self_rag.contract",
    "RetrievalDecision": "self_rag.contract",
    "CriticBackend": "self_rag.backend",
    "PromptedCritic": "self_rag.prompted_critic",
    "ReflectionCritic": "llamacpp.reflection_critic",
    "LlamaCppBackend": "llamacpp.backend",
    "ServedReflectionCritic": "served.reflection_critic",
    "find_best_segments": "rse.segments",
    "get_preset": "rse.values",
    "PRESETS": "rse.values",
    "plot_segments": "rse.plot",
    "download_llama_pack": "download",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
