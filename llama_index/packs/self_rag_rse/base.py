"""Import path of the upstream pack's docs: ``from ...self_rag_rse.base import SelfRAGQueryEngine``."""

from llama_index.packs.self_rag_rse.pack import SelfRAGPack
from llama_index.packs.self_rag_rse.query_engine import SelfRAGQueryEngine

__all__ = ["SelfRAGPack", "SelfRAGQueryEngine"]
