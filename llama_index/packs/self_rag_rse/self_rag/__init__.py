"""Self-RAG for LlamaIndex: the engine above the critic floor (``critic/``), read bottom-up.

``record`` is what a query did, typed (it becomes ``metadata["self_rag"]``). The flow
(``retrieval``, ``flow``, ``short_form``, ``long_form``, ``trace``) runs over a
:class:`~.flow.FlowParts` record and never sees the engine; ``options`` holds the engine's
options and their checks, ``engine`` the user-facing ``SelfRAGQueryEngine``. ``factory`` is the
one module here that imports a transport (``llamacpp/``, ``served/``): it builds critics from
what users pass.
"""
