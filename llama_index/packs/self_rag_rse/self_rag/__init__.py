"""Self-RAG for LlamaIndex: the engine above the critic floor (``critic/``), read bottom-up.

The flow (``retrieval``, ``flow``, ``short_form``, ``long_form``, ``trace``) runs over a
:class:`~.flow.FlowParts` record and never sees the engine; ``engine`` is the user-facing
``SelfRAGQueryEngine``. ``factory`` is the one module here that imports a transport
(``llamacpp/``, ``served/``): it builds critics from what users pass.
"""
