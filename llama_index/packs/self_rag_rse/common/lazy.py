"""Public names imported on first use: a package's ``__getattr__`` and ``__dir__``.

A package lists where each public name lives (``{"RelevantSegmentPostprocessor":
"rse.postprocessor", ...}``); importing the package then costs nothing, and a name's module
(with its optional dependencies) loads when the name is first used.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``: each name in ``exports`` is read from the
    submodule it maps to (relative to ``package``) on first use, then kept in the package."""

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__
