"""Public names imported on first use: a package's ``__getattr__``, ``__dir__`` and ``__all__``.

A package imports its public names under ``if TYPE_CHECKING:`` only, so type checkers and IDEs
see them while importing the package costs nothing; those imports are also the table read here
(one list, not two), and a name's module (with its optional dependencies) loads when the name is
first used.
"""

from __future__ import annotations

import ast
import importlib
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def lazy_exports(
    package: str, init_file: str
) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``, whose ``__init__`` is ``init_file``:
    each name imported in its ``if TYPE_CHECKING:`` block is read from its module on first use,
    then kept in the package.
    """
    tree = ast.parse(Path(init_file).read_text(encoding="utf-8"))
    exports = {
        alias.name: statement.module
        for block in tree.body
        if isinstance(block, ast.If)
        for statement in block.body
        if isinstance(statement, ast.ImportFrom) and statement.module
        for alias in statement.names
    }

    def __getattr__(name: str) -> Any:
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted({*vars(sys.modules[package]), *exports})

    return __getattr__, __dir__, sorted(exports)
