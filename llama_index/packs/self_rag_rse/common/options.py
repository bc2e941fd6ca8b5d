"""Unknown options are errors: a misspelt keyword must not silently fall back to a default.

LlamaIndex's pydantic components ignore extra fields, so ``threshold=0.2`` misspelt as
``treshold=0.2`` would be accepted and the default used. Every public constructor of this package
checks its keyword arguments here first.
"""

from __future__ import annotations

import difflib
import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Any


def reject_unknown(
    owner: str, given: Mapping[str, Any] | Iterable[str], valid: Iterable[str]
) -> None:
    """Raise ``TypeError`` naming each unknown option of ``owner`` and the closest valid one.

    ``given`` is the keyword arguments received (or their names); ``valid`` every name that
    ``owner`` accepts.
    """
    known = sorted(set(valid))
    unknown = [name for name in given if name not in known]
    if not unknown:
        return
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"{owner} got unknown option{'s' if len(parts) > 1 else ''} {', '.join(parts)}; "
        f"valid options: {', '.join(known)}"
    )


def pydantic_fields(cls: Any) -> set[str]:
    """Names a pydantic model accepts as keyword arguments (field names and their aliases)."""
    fields = getattr(cls, "model_fields", {})
    return set(fields) | {info.alias for info in fields.values() if getattr(info, "alias", None)}


def require_finite(owner: str, **values: float | None) -> None:
    """Raise ``ValueError`` when a numeric option is NaN or infinite (``None`` is allowed)."""
    for name, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{owner}: {name} must be a number, got {value!r}")
        if not math.isfinite(float(value)):
            raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")


def require_counts(owner: str, **values: Any) -> None:
    """Raise ``ValueError`` unless each option is an integer >= 1 (``None`` is allowed)."""
    for name, value in values.items():
        whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        if value is not None and not (whole and value >= 1):
            raise ValueError(f"{owner}: {name} must be an integer >= 1, got {value!r}")
