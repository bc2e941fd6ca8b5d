"""Fixtures of the engine tests: engines on the tiny Self-RAG model, and models that close.

``make_engine(**options)`` builds the engine most tests ask about (the session's tiny model, the
fixed retriever, ``mode="always_retrieve"``; any option may be overridden) and closes every
engine it built when the test ends. ``open_llama(path, **kwargs)`` opens a ``Llama`` with the
session's settings (F32 KV cache, one thread) and closes it when the test ends;
``talkative_llm`` and ``long_form_llm`` are the session's models for streaming and long form.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from models import load_llama
from retrievers import FixedRetriever

from llama_index.packs.self_rag_rse import SelfRAGQueryEngine


@pytest.fixture
def open_llama() -> Iterator[Callable[..., Any]]:
    opened: list[Any] = []

    def open_(path: Path, **kwargs: Any) -> Any:
        opened.append(load_llama(path, **kwargs))
        return opened[-1]

    yield open_
    for llm in opened:
        llm.close()


@pytest.fixture
def make_engine(tiny_llm: Any) -> Iterator[Callable[..., SelfRAGQueryEngine]]:
    built: list[SelfRAGQueryEngine] = []

    def make(**options: Any) -> SelfRAGQueryEngine:
        settings: dict[str, Any] = {"mode": "always_retrieve"}
        settings.update(options)
        if "critic" not in settings or isinstance(settings["critic"], str):
            settings.setdefault("llm", tiny_llm)
        settings.setdefault("retriever", FixedRetriever())
        built.append(SelfRAGQueryEngine(**settings))
        return built[-1]

    yield make
    for engine in built:
        engine.close()
