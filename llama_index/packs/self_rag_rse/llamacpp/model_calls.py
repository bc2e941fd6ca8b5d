"""The batched decoder's sequences as model calls in LlamaIndex instrumentation.

Each request a :class:`~.conversation.Conversation` decodes is one model call, reported as core's
LLM events (:class:`~llama_index.packs.self_rag_rse.common.tracing.ModelCalls`) in a span of its
own: its prompt and completion as text (Self-RAG's reflection tokens shown), the prompt tokens
evaluated for it and the tokens it generated (:class:`~.sequences.SequenceOutput`). Summed over a
call they are what :class:`~.context.DecodeStats` counts. Nothing is turned into text while no
handler listens.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from llama_index.packs.self_rag_rse.common.tracing import Completed, ModelCalls
from llama_index.packs.self_rag_rse.llamacpp.sequences import Request, SequenceOutput


def traced(
    decode: Callable[[Sequence[Request]], list[SequenceOutput]],
    requests: Sequence[Request],
    *,
    model: str,
    text: Callable[[Sequence[int]], str],
) -> list[SequenceOutput]:
    """``decode(requests)``, each request reported as a model call of ``model``; ``text``
    shows tokens as text.
    """
    with ModelCalls(
        "BatchedDecoder.complete",
        model,
        prompts=lambda: [text(request.tokens) for request in requests],
    ) as calls:
        outputs = decode(requests)
        calls.end(
            lambda: [
                Completed(text(out.tokens), out.prompt_tokens, len(out.tokens)) for out in outputs
            ]
        )
    return outputs
