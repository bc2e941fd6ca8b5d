"""Self-RAG query engine and Relevant Segment Extraction for LlamaIndex.

The public names below are imported on first use, so ``import llama_index.packs.self_rag_rse``
stays cheap and optional dependencies (llama-cpp-python, matplotlib) load only when a component
that needs them is used. Internals stay importable from their modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:
    from llama_index.packs.self_rag_rse.context.headers import ContextualHeaders
    from llama_index.packs.self_rag_rse.context.sectioner import DocumentSectioner
    from llama_index.packs.self_rag_rse.download import download_llama_pack
    from llama_index.packs.self_rag_rse.pack import SelfRAGPack
    from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY, ChunkIndexer
    from llama_index.packs.self_rag_rse.rse.plot import plot_segments
    from llama_index.packs.self_rag_rse.rse.postprocessor import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.rse.segments import PRESETS, find_best_segments, get_preset
    from llama_index.packs.self_rag_rse.self_rag.backend import CriticBackend
    from llama_index.packs.self_rag_rse.self_rag.contract import (
        Critic,
        ParagraphJudgement,
        RetrievalDecision,
    )
    from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.self_rag.prompted_critic import PromptedCritic
    from llama_index.packs.self_rag_rse.self_rag.reflection_critic import ReflectionCritic
    from llama_index.packs.self_rag_rse.served.reflection_critic import ServedReflectionCritic

#: Public name -> module that defines it.
_EXPORTS = {
    "SelfRAGQueryEngine": "self_rag.engine",
    "SelfRAGPack": "pack",
    "RelevantSegmentPostprocessor": "rse.postprocessor",
    "ChunkIndexer": "rse.chunk_index",
    "DocumentSectioner": "context.sectioner",
    "ContextualHeaders": "context.headers",
    "CHUNK_INDEX_KEY": "rse.chunk_index",
    "Critic": "self_rag.contract",
    "ParagraphJudgement": "self_rag.contract",
    "RetrievalDecision": "self_rag.contract",
    "CriticBackend": "self_rag.backend",
    "PromptedCritic": "self_rag.prompted_critic",
    "ReflectionCritic": "self_rag.reflection_critic",
    "ServedReflectionCritic": "served.reflection_critic",
    "find_best_segments": "rse.segments",
    "get_preset": "rse.segments",
    "PRESETS": "rse.segments",
    "plot_segments": "rse.plot",
    "download_llama_pack": "download",
}

__all__ = ["CHUNK_INDEX_KEY", "PRESETS", "ChunkIndexer", "ContextualHeaders", "Critic", "CriticBackend", "DocumentSectioner", "ParagraphJudgement", "PromptedCritic", "ReflectionCritic", "RelevantSegmentPostprocessor", "RetrievalDecision", "SelfRAGPack", "SelfRAGQueryEngine", "ServedReflectionCritic", "download_llama_pack", "find_best_segments", "get_preset", "plot_segments"]  # fmt: skip  # noqa: E501


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
