"""Self-RAG query engine and Relevant Segment Extraction for LlamaIndex.

The public names below are imported on first use, so ``import llama_index.packs.self_rag_rse``
stays cheap and optional dependencies (llama-cpp-python, matplotlib) load only when a component
that needs them is used. Internals stay importable from their modules.
"""

# ruff: noqa: F401 - the TYPE_CHECKING imports are the public names, loaded on first use

from __future__ import annotations

from typing import TYPE_CHECKING

from llama_index.packs.self_rag_rse.common.lazy import lazy_exports

if TYPE_CHECKING:  # the public names: what type checkers see, and the lazy table
    from llama_index.packs.self_rag_rse.context.headers import ContextualHeaders
    from llama_index.packs.self_rag_rse.context.sectioner import DocumentSectioner
    from llama_index.packs.self_rag_rse.critic.backend import CriticBackend
    from llama_index.packs.self_rag_rse.critic.contract import (
        BaseCritic,
        ParagraphJudgement,
        RetrievalDecision,
    )
    from llama_index.packs.self_rag_rse.critic.prompted_critic import PromptedCritic
    from llama_index.packs.self_rag_rse.download import download_llama_pack
    from llama_index.packs.self_rag_rse.llamacpp.backend import LlamaCppBackend
    from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic
    from llama_index.packs.self_rag_rse.pack import SelfRAGPack
    from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY, ChunkIndexer
    from llama_index.packs.self_rag_rse.rse.events import SegmentsExtractedEvent
    from llama_index.packs.self_rag_rse.rse.plot import plot_segments
    from llama_index.packs.self_rag_rse.rse.postprocessor import RelevantSegmentPostprocessor
    from llama_index.packs.self_rag_rse.rse.segments import find_best_segments
    from llama_index.packs.self_rag_rse.rse.types import SegmentExtraction
    from llama_index.packs.self_rag_rse.rse.values import PRESETS, get_preset
    from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine
    from llama_index.packs.self_rag_rse.self_rag.events import (
        AnswerChosenEvent,
        ParagraphJudgedEvent,
        SegmentCitedEvent,
        SelfRAGStepEvent,
    )
    from llama_index.packs.self_rag_rse.served.reflection_critic import ServedReflectionCritic

__getattr__, __dir__, __all__ = lazy_exports(__name__, __file__)
