"""Self-RAG query engine and Relevant Segment Extraction for LlamaIndex."""

from llama_index.packs.self_rag_rse.rse.calibration import (
    COHERE_RERANK_BETA,
    VOYAGE_RERANK_BETA,
    beta_cdf,
    calibrate_beta,
    calibrate_minmax,
)
from llama_index.packs.self_rag_rse.rse.chunk_index import CHUNK_INDEX_KEY, ChunkIndexer
from llama_index.packs.self_rag_rse.self_rag.contract import (
    Critic,
    ParagraphJudgement,
    RetrievalDecision,
    final_score,
)
from llama_index.packs.self_rag_rse.self_rag.labels import LabelScale, parse_reply
from llama_index.packs.self_rag_rse.llamacpp.decoder import BatchedDecoder, SequenceOutput
from llama_index.packs.self_rag_rse.pack import SelfRAGPack
from llama_index.packs.self_rag_rse.rse.plot import plot_segments
from llama_index.packs.self_rag_rse.rse.postprocessor import (
    RelevantSegmentPostprocessor,
    Segment,
    SegmentExtraction,
)
from llama_index.packs.self_rag_rse.self_rag.prompted_critic import PromptedCritic
from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine
from llama_index.packs.self_rag_rse.self_rag.reflection import REFLECTION_TOKENS, score_generation
from llama_index.packs.self_rag_rse.self_rag.reflection_critic import ReflectionCritic
from llama_index.packs.self_rag_rse.rse.segments import (
    PRESETS,
    RSEPreset,
    adjust_for_length,
    chunk_value,
    find_best_segments,
    get_preset,
)

__all__ = ["CHUNK_INDEX_KEY", "COHERE_RERANK_BETA", "PRESETS", "REFLECTION_TOKENS", "VOYAGE_RERANK_BETA", "BatchedDecoder", "ChunkIndexer", "Critic", "LabelScale", "ParagraphJudgement", "PromptedCritic", "RSEPreset", "ReflectionCritic", "RelevantSegmentPostprocessor", "RetrievalDecision", "Segment", "SegmentExtraction", "SelfRAGPack", "SelfRAGQueryEngine", "SequenceOutput", "adjust_for_length", "beta_cdf", "calibrate_beta", "calibrate_minmax", "chunk_value", "final_score", "find_best_segments", "get_preset", "parse_reply", "plot_segments", "score_generation"]  # fmt: skip  # noqa: E501
