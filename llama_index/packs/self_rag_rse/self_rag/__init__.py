"""Self-RAG for LlamaIndex, read bottom-up: the critic contract (``contract``), reflection scoring
(``reflection``, ``labels``), prompts and the backend contract (``prompts``, ``backend``,
``llm_backend``), the prompted critic, then the engine (``engine``, ``steps``, ``trace``).
``factory`` is the one module that builds critics from the transports (``llamacpp``,
``served``)."""
