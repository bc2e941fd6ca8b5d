"""Relevant Segment Extraction (dsRAG) for LlamaIndex: pure search core, store reads, the postprocessor."""
