"""Self-RAG models behind a server: llama.cpp's ``llama-server``, llama-cpp-python's server,
vLLM, any ``/v1/completions``.

The reflection critic here speaks HTTP instead of decoding in process, and scores with the same code
(:mod:`..critic.reflection`). Layers, bottom-up: :mod:`.wire` reads response bodies (pure),
:mod:`.errors` names what went wrong (the URL in each message, its password masked), :mod:`.http`
sends requests (timeouts, bounded concurrency, answers bounded in size), :mod:`.greedy`
says what makes each kind of server decode greedily and checks that it did, :mod:`.apis` is the
contract that :mod:`.llamacpp_api` (llama.cpp's native API) and :mod:`.openai_api` (the OpenAI one)
implement, :mod:`.followups` completes what a completion left out, and :mod:`.reflection_critic` is
the critic. :mod:`.endpoint` reads the server URL off an OpenAI-compatible LlamaIndex LLM, which is
how ``SelfRAGQueryEngine(llm=OpenAILike(...), critic="reflection")`` finds the server.
"""

from llama_index.packs.self_rag_rse.served.apis import ReflectionTokensUnidentifiable
from llama_index.packs.self_rag_rse.served.errors import (
    MalformedResponse,
    ServerError,
    ServerHTTPError,
    ServerRedirect,
    ServerTimeout,
    ServerUnavailable,
)
from llama_index.packs.self_rag_rse.served.greedy import ServerNotGreedy
from llama_index.packs.self_rag_rse.served.reflection_critic import ServedReflectionCritic

__all__ = [
    "MalformedResponse",
    "ReflectionTokensUnidentifiable",
    "ServedReflectionCritic",
    "ServerError",
    "ServerHTTPError",
    "ServerNotGreedy",
    "ServerRedirect",
    "ServerTimeout",
    "ServerUnavailable",
]
