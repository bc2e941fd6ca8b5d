"""The upstream pack's import path: ``from <pack>.base import SelfRAGQueryEngine`` keeps working."""

from llama_index.packs.self_rag_rse.pack import SelfRAGPack
from llama_index.packs.self_rag_rse.self_rag.engine import SelfRAGQueryEngine

__all__ = ["SelfRAGPack", "SelfRAGQueryEngine"]
