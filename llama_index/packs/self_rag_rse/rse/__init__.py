"""Relevant Segment Extraction (dsRAG) for LlamaIndex, in layers read bottom-up.

- ``segments`` (the search), ``budget`` (the search under a context budget), ``values``
  (chunk values, presets, a budget's limits), ``calibration``, ``stitching``, ``types``: numpy
  and text only;
- ``node_fields`` (what is read off a node, checked), ``chunk_index``, ``chunk_sources``,
  ``ordering`` (the evidence on order), ``layout`` (chunks placed, holes, reads), ``segment_nodes``,
  ``selection`` (one interface for everything a budget changes, and dsRAG's chunk counts),
  ``context_budget`` (the other policy: what nodes cost, the search within the budget, the one
  correction): adapters to LlamaIndex nodes and stores;
- ``options`` (what can be set, checked on every assignment) and ``postprocessor``: the
  user-facing ``RelevantSegmentPostprocessor``; ``plot``: a picture of it.
"""
