"""Building critics from what users pass: a GGUF path, a ``LlamaCPP``, a ``Llama`` or any LLM.

This is the only place that looks at *what kind* of model it was given; critics and the engine
receive built parts. Whoever loads a model owns it: :func:`build_critic` reports whether it
loaded one, and the engine closes that model when it is closed.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Mapping
from inspect import signature
from typing import Any

from llama_index.packs.self_rag_rse.common.options import reject_unknown
from llama_index.packs.self_rag_rse.common.urls import mask_url
from llama_index.packs.self_rag_rse.critic.backend import CriticBackend
from llama_index.packs.self_rag_rse.critic.contract import BaseCritic
from llama_index.packs.self_rag_rse.critic.prompted_critic import PromptedCritic
from llama_index.packs.self_rag_rse.critic.reflection import MissingReflectionTokens
from llama_index.packs.self_rag_rse.llamacpp.compat import import_llama_cpp, is_closed, llama_of

logger = logging.getLogger(__name__)

#: Model settings used when a GGUF is loaded here (``model_path``). Unlike the upstream pack
#: there is no ``logits_all``: the critic reads only the logits it needs.
DEFAULT_MODEL_KWARGS: dict[str, Any] = {"n_ctx": 2048, "n_gpu_layers": -1, "verbose": False}

CRITIC_CHOICES = ("auto", "reflection", "prompted")


def load_llama(model_path: str, model_kwargs: Mapping[str, Any] | None = None) -> Any:
    """A ``llama_cpp.Llama`` on the GGUF at ``model_path`` (:data:`DEFAULT_MODEL_KWARGS` under
    ``model_kwargs``); the engine's ``model_path=`` loads through here.
    """
    llama = import_llama_cpp("model_path").Llama
    given = dict(model_kwargs or {})
    # Llama drops keyword arguments it does not know: a misspelt option would vanish.
    reject_unknown("model_kwargs", given, signature(llama).parameters)
    return llama(model_path=str(model_path), **{**DEFAULT_MODEL_KWARGS, **given})


def _backend(model: Any, max_new_tokens: int) -> CriticBackend:
    """Batched llama.cpp decoding for a ``LlamaCPP`` or ``llama_cpp.Llama``; concurrent calls
    for any other LlamaIndex ``LLM``.
    """
    from llama_index.core.llms import LLM

    if llama_of(model) is not None:
        from llama_index.packs.self_rag_rse.llamacpp.backend import LlamaCppBackend

        return LlamaCppBackend(model, max_new_tokens=max_new_tokens)
    if isinstance(model, LLM):
        from llama_index.packs.self_rag_rse.critic.llm_backend import LLMBackend

        return LLMBackend(model)
    raise TypeError(
        f"llm must be a LlamaIndex LLM or a llama_cpp.Llama, got {type(model).__name__}: pass "
        "a LlamaCPP, a llama_cpp.Llama or any LlamaIndex LLM (e.g. OpenAILike(api_base=...))"
    )


def build_critic(
    critic: str | BaseCritic = "auto",
    *,
    llm: Any = None,
    model_path: str | None = None,
    model_kwargs: Mapping[str, Any] | None = None,
    generator_llm: Any = None,
    max_new_tokens: int = 50,
) -> tuple[BaseCritic, Any]:
    """Choose and build the critic the engine's arguments ask for; returns it and the model
    loaded for it from ``model_path`` (``None`` when the caller passed one), which the caller
    closes.

    ``critic`` is ``"reflection"`` (a llama.cpp model with Self-RAG's reflection tokens, or an
    OpenAI-compatible LLM whose server serves one), ``"prompted"`` (any LLM), ``"auto"``
    (reflection when the model has every reflection token, prompted otherwise, with a warning
    when it has only some) or a built critic. For a served LLM (``OpenAILike``,
    ``OpenAI(api_base=...)``), ``"auto"`` asks the server whether its model has the tokens:
    completion models only, never a hosted API such as api.openai.com.
    """
    if model_kwargs and model_path is None:
        raise ValueError(
            "model_kwargs= applies to the model loaded from model_path=: set those options on "
            "the model you pass"
        )
    if isinstance(critic, BaseCritic):
        if llm is not None or model_path is not None or generator_llm is not None:
            raise ValueError(
                "pass either a built critic or llm=/model_path=/generator_llm= to build one: a "
                "built critic already has its models"
            )
        return critic, None
    if not isinstance(critic, str):
        raise TypeError(
            f"critic must be 'auto', 'reflection', 'prompted' or a built critic (a subclass of "
            f"BaseCritic), got {type(critic).__name__}: pass one of the names, or an instance of "
            "your BaseCritic subclass"
        )
    if critic not in CRITIC_CHOICES:
        raise ValueError(
            f"critic must be 'auto', 'reflection', 'prompted' or a built critic, got {critic!r}: "
            "pass one of those names (auto chooses by the model's vocabulary)"
        )
    if llm is None and model_path is None:
        raise ValueError(
            "no model to build the critic from: pass model_path= (a Self-RAG GGUF) or llm= (a "
            "LlamaCPP, llama_cpp.Llama or any LlamaIndex LLM)"
        )
    if llm is not None and model_path is not None:
        raise ValueError(
            "pass model_path= or llm=, not both: model_path= loads a model, llm= is one already "
            "loaded"
        )
    loaded = None
    if model_path is not None:
        llm = loaded = load_llama(model_path, model_kwargs)
    try:
        return _choose(critic, llm, generator_llm, max_new_tokens=max_new_tokens), loaded
    except BaseException:
        if loaded is not None:
            loaded.close()
        raise


def _choose(critic: str, llm: Any, generator_llm: Any, *, max_new_tokens: int) -> BaseCritic:
    raw = llama_of(llm)
    # A closed model is not read here (tokenizing it would crash): building its backend raises.
    if critic == "auto" and generator_llm is not None and raw is not None and not is_closed(raw):
        from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import (
            reflection_token_ids,
        )

        # The rest runs only for a model with every reflection token, which users may expect
        # to score with them.
        with contextlib.suppress(MissingReflectionTokens):
            reflection_token_ids(raw)
            message = (
                "llm= has Self-RAG's reflection tokens, but with generator_llm= the prompted "
                "critic is used (the reflection critic scores the model's own answers): drop "
                "generator_llm= to score with the reflection tokens, or pass critic='prompted' "
                "to silence this"
            )
            logger.warning(message)
            warnings.warn(message, stacklevel=4)
    # The reflection critic scores the model's own answers: there is no separate generator.
    may_reflect = critic in ("auto", "reflection") and generator_llm is None
    if may_reflect and raw is not None:
        from llama_index.packs.self_rag_rse.llamacpp.reflection_critic import ReflectionCritic

        try:
            return ReflectionCritic(raw, max_new_tokens=max_new_tokens)
        except MissingReflectionTokens as missing:
            if critic == "reflection":
                raise
            if missing.found:
                # Some tokens but not all: probably a Self-RAG GGUF with a broken vocabulary.
                message = (
                    f"the model has only some Self-RAG reflection tokens (missing: "
                    f"{', '.join(missing.missing)}), so the prompted critic is used; pass a "
                    "complete Self-RAG GGUF for reflection scores, or critic='prompted' to "
                    "silence this"
                )
                logger.warning(message)
                warnings.warn(message, stacklevel=4)
            else:
                logger.info("model has no reflection tokens: using the prompted critic")
    elif may_reflect:
        served = _served_reflection(critic, llm, max_new_tokens=max_new_tokens)
        if served is not None:
            return served
    if critic == "reflection":
        if generator_llm is not None:
            raise ValueError(
                "critic='reflection' scores the model's own answers: generator_llm= works with "
                "critic='prompted' only"
            )
        raise ValueError(
            "critic='reflection' needs a llama.cpp model with Self-RAG reflection tokens "
            "(model_path=, a LlamaCPP or a llama_cpp.Llama) or an OpenAI-compatible LLM on a "
            "server that serves one (OpenAILike(api_base=...)); use critic='prompted' for other "
            "LLMs"
        )
    backend = _backend(llm, max_new_tokens)
    if generator_llm is None or generator_llm is llm:
        return PromptedCritic(backend)
    try:
        generator = _backend(generator_llm, max_new_tokens)
    except BaseException:
        backend.close()
        raise
    return PromptedCritic(backend, generator_backend=generator)


def _served_reflection(critic: str, llm: Any, *, max_new_tokens: int) -> BaseCritic | None:
    """The served reflection critic for an OpenAI-compatible LLM whose server has the tokens.

    ``None`` when ``llm`` is not served, or (``critic="auto"``) when it is a chat model, a hosted
    API, or its server's model lacks (or cannot identify) the reflection tokens. With
    ``critic="reflection"`` those cases raise, and so does an unreachable server in both modes.
    """
    from llama_index.packs.self_rag_rse.served.endpoint import endpoint_of

    endpoint = endpoint_of(llm)
    if endpoint is None:
        return None
    # A chat model or a hosted API serves no raw completions to read reflection tokens from.
    if critic == "auto" and (endpoint.is_chat_model or endpoint.hosted):
        return None
    from llama_index.packs.self_rag_rse.served.apis import ReflectionTokensUnidentifiable
    from llama_index.packs.self_rag_rse.served.reflection_critic import ServedReflectionCritic

    served = ServedReflectionCritic.from_llm(llm, max_new_tokens=max_new_tokens)
    try:
        info = served.connect()
    except (MissingReflectionTokens, ReflectionTokensUnidentifiable) as problem:
        served.close()
        if critic == "reflection":
            raise
        partial = isinstance(problem, MissingReflectionTokens) and problem.found
        if partial or isinstance(problem, ReflectionTokensUnidentifiable):
            message = f"{problem}; the prompted critic is used (critic='prompted' silences this)"
            logger.warning(message)
            warnings.warn(message, stacklevel=5)
        else:
            logger.info("served model has no reflection tokens: using the prompted critic")
        return None
    except BaseException:
        served.close()
        raise
    if critic == "auto" and not info.verified:
        served.close()
        logger.info(
            "%s cannot confirm reflection tokens: using the prompted critic (pass "
            "critic='reflection' to use the served reflection critic anyway)",
            mask_url(endpoint.base_url),
        )
        return None
    return served
