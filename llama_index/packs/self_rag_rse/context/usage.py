"""What a context component's last run cost: documents, LLM calls, cache hits, time."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["ContextUsage"]


@dataclass
class ContextUsage:
    """Cost of one run of a context component.

    ``llm_calls`` counts calls actually sent to the LLM; ``cached`` the results read from the
    cache instead; ``rejected`` the sectioning windows whose LLM answer could not be used (with
    the reason), ``repairs`` the fixes made to answers that were used.
    """

    documents: int = 0
    llm_calls: int = 0
    cached: int = 0
    seconds: float = 0.0
    rejected: list[str] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-able copy."""
        return asdict(self)
