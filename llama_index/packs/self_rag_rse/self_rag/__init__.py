"""Self-RAG for LlamaIndex: reflection scoring, critics and the query engine."""
