"""Context for chunks and segments (dsRAG's contextual chunk headers and sectioning).

Layers, read bottom-up:

- ``sections``, ``headings``, ``partition``, ``compose``: pure Python (no LlamaIndex): section
  ranges, the structural heading finder, checking and repairing an LLM's partition of numbered
  lines, the words of a header;
- ``cache``, ``prompts``, ``llm_sections``, ``segment_header``: adapters to LlamaIndex
  (key-value stores, prompt templates, structured output, nodes); ``component``: what both
  components share (their base class, the cost of a run, telling documents from chunks);
- ``sectioner`` (:class:`DocumentSectioner`) and ``headers`` (:class:`ContextualHeaders`): the
  ingestion components users put in an ``IngestionPipeline``; ``keys``: the metadata they write.
"""
