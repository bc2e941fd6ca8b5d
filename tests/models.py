"""Helpers for the tests that open the tiny Self-RAG GGUFs: one loader with one settings table
for every ``Llama`` the tests open, and two oracles computed with numpy from a ``logits_all``
model (full-vocabulary log-probs, plain greedy decoding).

Every Llama here keeps its KV cache in F32 (type_k = type_v = 0): with llama.cpp's default F16
cache, batches of different shapes round K/V differently and log-probs drift by ~3e-4, which
would blur the "exact scores" checks (the decoder inherits the cache type from the Llama).
``tests/conftest.py`` builds its session fixtures with these; test modules import them from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ggml's type id of 32-bit floats (the KV cache type every test Llama uses).
GGML_TYPE_F32 = 0


def load_llama(path: Path, **kwargs: Any) -> Any:
    """A ``llama_cpp.Llama`` on the GGUF at ``path`` with the tests' settings (``kwargs`` win)."""
    import llama_cpp

    options: dict[str, Any] = {
        "n_ctx": 1024,
        # One thread: the tiny model gains nothing from two, and llama.cpp's spinning thread
        # barriers slow down 20x when other processes compete for the cores.
        "n_threads": 1,
        "n_threads_batch": 1,
        "type_k": GGML_TYPE_F32,
        "type_v": GGML_TYPE_F32,
        "verbose": False,
    }
    options.update(kwargs)
    return llama_cpp.Llama(str(path), **options)


def reference_logprobs(ref_llm: Any, context: list[int], generated: list[int]) -> Any:
    """Full-vocabulary log-softmax at each generated position, by a ``logits_all`` Llama.

    Row ``i`` is the distribution of ``generated[i]`` given ``context + generated[:i]``, computed
    with numpy from ``Llama.scores`` (the raw logits) in float64.
    """
    import numpy as np

    ref_llm.reset()
    ref_llm.eval(context + generated[:-1])
    start = len(context) - 1
    rows = np.asarray(ref_llm.scores[start : start + len(generated)], dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))


def reference_greedy(ref_llm: Any, context: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding, one token at a time, stopping after EOS (which is kept)."""
    import numpy as np

    ref_llm.reset()
    ref_llm.eval(context)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        token = int(np.argmax(ref_llm.scores[ref_llm.n_tokens - 1]))
        generated.append(token)
        if token == ref_llm.token_eos():
            break
        ref_llm.eval([token])
    return generated
