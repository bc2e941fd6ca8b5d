"""Relevant Segment Extraction (dsRAG) for LlamaIndex, in layers read bottom-up.

- ``segments`` (the search), ``calibration``, ``stitching``, ``types``: numpy and text only;
- ``chunk_index``, ``chunk_sources``, ``ordering``, ``segment_nodes``: adapters to LlamaIndex
  nodes and stores;
- ``postprocessor``: the user-facing ``RelevantSegmentPostprocessor``; ``plot``: a picture of it.
"""
