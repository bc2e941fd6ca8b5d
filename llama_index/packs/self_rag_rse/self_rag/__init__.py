"""Self-RAG for LlamaIndex, read bottom-up: the critic contract (``contract``), reflection scoring
(``reflection``, ``labels``), prompts and the backend contract (``prompts``, ``backend``,
``llm_backend``), the prompted critic, then the flow (``retrieval``, ``flow``, ``short_form``,
``long_form``, ``trace``) and the engine (``engine``). ``factory`` is the one module that
builds critics from the transports (``llamacpp``, ``served``)."""
