"""The critic floor: what the Self-RAG engine and every transport stand on.

Read bottom-up: reflection scoring and label reading (``reflection``, ``labels``: pure), the
prompts (``prompts``), the critic contract (``contract``: ``BaseCritic`` and what it returns),
the decoding backends' contract (``backend``: continue k prompts, read label probabilities) and
its implementation over any LlamaIndex LLM (``llm_backend``), then the prompted critic
(``prompted_critic``) and the critic as the engine calls it, every result checked against the
contract (``checked``). Nothing here imports ``self_rag/``, a transport (``llamacpp/``,
``served/``) or ``rse/``: they import this.
"""
