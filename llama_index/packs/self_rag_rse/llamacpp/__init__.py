"""Everything that touches llama-cpp-python, bottom-up: ``compat`` (its private attributes),
``context`` (one native context), ``sequences`` and ``plan`` (what is decoded), ``conversation`` and
``decoder`` (batched greedy decoding with shared prefixes), ``worker`` (the thread that drives a
decoder), then the two critics built on it: ``reflection_critic`` (Self-RAG GGUFs) and ``backend``
(the prompted critic's llama.cpp backend). ``chat_format`` renders a GGUF's chat template.
"""
