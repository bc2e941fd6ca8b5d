"""The contract between the evaluation runner and a judge: score one metric of one answer.

A judge turns a :class:`Sample` (question, answer, retrieved contexts, optional reference) into
one number per metric. Two implementations: RAGAS through its LlamaIndex wrappers
(:mod:`.ragas_judge`) and LlamaIndex's own evaluators (:mod:`.llamaindex_judge`). The runner owns
concurrency, timeouts, retries and caching; a judge only scores, and raises when it cannot
(:class:`JudgementError` for a reply it could not read): the runner records the failure and goes
on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Sample:
    """What a judge sees of one engine's answer to one question."""

    question: str
    answer: str
    contexts: tuple[str, ...] = ()
    reference: str | None = None


class JudgementError(RuntimeError):
    """The judge answered, but no score could be read from it (unparsable reply, NaN)."""


class Judge(ABC):
    """Scores answers on named metrics (scores in [0, 1], higher is better)."""

    #: Short name of the implementation (``"ragas"``, ``"llamaindex"``).
    backend: str = "judge"

    @property
    @abstractmethod
    def identity(self) -> str:
        """Who judges: implementation and model. Part of the cache key, so a different judge
        never reuses another's judgements."""

    @property
    @abstractmethod
    def metric_names(self) -> tuple[str, ...]:
        """Every metric this judge can score, in report order."""

    @abstractmethod
    def applicable(self, metric: str, sample: Sample) -> bool:
        """Whether ``metric`` can be scored on ``sample`` (e.g. context recall needs a
        reference, faithfulness needs retrieved contexts)."""

    @abstractmethod
    async def ascore(self, metric: str, sample: Sample) -> float:
        """The score of ``sample`` on ``metric``; raises when the judge cannot give one."""

    def describe(self) -> dict[str, Any]:
        """Facts for the report: implementation, model, metrics."""
        return {"backend": self.backend, "identity": self.identity, "metrics": self.metric_names}


def llm_label(llm: Any) -> str:
    """A short, stable name for an LLM: its class, model (a GGUF's file name) and reply length."""
    model, tokens = "", None
    try:
        model = str(llm.metadata.model_name or "")
        tokens = llm.metadata.num_output
    except Exception:  # a label must never fail
        model = str(getattr(llm, "model", "") or "")
    if model.endswith(".gguf"):
        model = Path(model).name
    # The reply length changes what a judge can say (a JSON list cut short fails to parse).
    parts = [p for p in (model, f"{tokens} tokens" if isinstance(tokens, int) else "") if p]
    return f"{type(llm).__name__}({', '.join(parts)})" if parts else type(llm).__name__


def embed_label(embed_model: Any) -> str:
    """A short, stable name for an embedding model."""
    name = str(getattr(embed_model, "model_name", "") or "")
    if Path(name).is_absolute():
        # A local model folder: its last two parts name it (e.g. a package and its folder).
        name = "/".join(Path(name).parts[-2:])
    return f"{type(embed_model).__name__}({name})" if name else type(embed_model).__name__
