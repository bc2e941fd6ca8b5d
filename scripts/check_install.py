"""Check that the pack installs and runs with its declared dependencies alone.

A development virtualenv hides undeclared dependencies: pytest brings ``packaging`` and (on
Python 3.10) ``tomli``, transformers brings more. This script builds the wheel, installs it into a
fresh virtualenv with no extras, and runs what a user of the bare install can run. ``make test``
runs it.

The steps:

1. ``build_wheel``: ``pip wheel --no-deps`` of the project into a temporary folder.
2. ``fresh_venv``: a new virtualenv; the wheel installed with its declared dependencies only.
Before them, ``declared_imports`` runs in the development virtualenv (where every extra is
installed): every third-party module that any file of the package imports, at top level or
inside a function, must belong to a distribution that ``pyproject.toml`` declares, in its
dependencies or in one of its extras. A module that is only there because another package pulled
it in does not count: this is the check that fails when a used dependency is left undeclared.

3. The rest runs in the new virtualenv (this same script, with ``--inside``):

   - ``public_names``: every name in ``__all__`` imports.
   - ``command_line``: ``self-rag-rse --help`` and ``self-rag-rse download-llamapack`` into a
     folder.
   - ``rse_pipeline``: an offline RSE pipeline (core's ``MockEmbedding``, an in-memory index).

Pass ``--keep DIR`` to build in DIR and keep it for a look afterwards.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "llama-index-packs-self-rag-rse"
PACKAGE = "llama_index.packs.self_rag_rse"


class CheckFailed(Exception):
    """A check failed; the message says which and why."""


def run(command: list[str], **kwargs: object) -> None:
    print("+", " ".join(command), flush=True)
    result = subprocess.run(command, check=False, **kwargs)  # type: ignore[call-overload]
    if result.returncode != 0:
        raise CheckFailed(f"{command[0]} exited with status {result.returncode}: {command}")


def build_wheel(out: Path) -> Path:
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(ROOT)])
    wheels = sorted(out.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckFailed(f"expected one wheel in {out}, found {wheels}")
    return wheels[0]


def fresh_venv(where: Path, wheel: Path) -> Path:
    run([sys.executable, "-m", "venv", str(where)])
    python = where / "bin" / "python"
    run([str(python), "-m", "pip", "install", "-q", str(wheel)])
    return python


# -- inside the fresh virtualenv ------------------------------------------------------------------


def _guarded(node: ast.Try) -> bool:
    """Whether a ``try`` catches ImportError: what it imports is optional by design (e.g. an
    older core's module).
    """
    names = {"ImportError", "ModuleNotFoundError"}
    for handler in node.handlers:
        caught = handler.type
        kinds = caught.elts if isinstance(caught, ast.Tuple) else [caught]
        if any(isinstance(k, ast.Name) and k.id in names for k in kinds):
            return True
    return False


def _imported_modules(package_dir: Path) -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package -> the files importing them
    (imports inside a ``try`` that catches ImportError are left out).
    """
    found: dict[str, set[str]] = {}
    for path in package_dir.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        optional = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.Try) and _guarded(node)
            for statement in node.body
            for inner in ast.walk(statement)
        }
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            if id(node) in optional:
                continue
            for name in names:
                found.setdefault(name, set()).add(str(path.relative_to(package_dir)))
    return found


def _declared_distributions() -> set[str]:
    """Every distribution pyproject.toml names: dependencies and every extra."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project.get("dependencies", []))
    for group in project.get("optional-dependencies", {}).values():
        requirements.extend(group)
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _providers(module: str, top_level: dict[str, list[str]]) -> set[str]:
    """Distributions that provide ``module``; a shared namespace is resolved by file path."""
    from packaging.utils import canonicalize_name

    head = module.split(".")[0]
    candidates = set(top_level.get(head, []))
    if len(candidates) > 1:  # llama_index is a namespace many distributions share
        parts = tuple(module.split("."))
        candidates = {
            dist
            for dist in candidates
            if any(
                Path(f).with_suffix("").parts[: len(parts)] == parts
                for f in metadata.distribution(dist).files or []
            )
        }
    return {canonicalize_name(d) for d in candidates}


def declared_imports() -> None:
    """Run in the development virtualenv, where every extra is installed."""
    from packaging.utils import canonicalize_name

    package_dir = ROOT / Path(*PACKAGE.split("."))
    top_level = metadata.packages_distributions()
    declared = _declared_distributions()
    problems = []
    for module, files in sorted(_imported_modules(package_dir).items()):
        if module.split(".")[0] in sys.stdlib_module_names or module.startswith(PACKAGE):
            continue
        providers = _providers(module, top_level)
        where = ", ".join(sorted(files))
        if not providers:
            # Not installed here: fine only when declared under its own name for another
            # environment (e.g. ``tomli; python_version < '3.11'``).
            if canonicalize_name(module.split(".")[0]) not in declared:
                problems.append(f"{module} (imported by {where}) is not installed here")
        elif not providers & declared:
            problems.append(
                f"{module} (imported by {where}) comes from {', '.join(sorted(providers))}, "
                "which pyproject.toml does not declare"
            )
    if problems:
        raise CheckFailed("undeclared dependencies:\n  " + "\n  ".join(problems))
    print("declared_imports: every imported module belongs to a declared distribution")


def public_names() -> None:
    package = importlib.import_module(PACKAGE)
    missing = []
    for name in package.__all__:
        try:
            getattr(package, name)
        except ImportError as error:
            missing.append(f"{name}: {error}")
    if missing:
        raise CheckFailed(
            "public names that do not import on a bare install:\n  " + "\n  ".join(missing)
        )
    print(f"public_names: {len(package.__all__)} names import")


def command_line(work: Path) -> None:
    command = Path(sys.executable).with_name("self-rag-rse")
    run([str(command), "--help"], stdout=subprocess.DEVNULL)
    run(
        [
            str(command),
            "download-llamapack",
            "RelevantSegmentPostprocessor",
            "--download-dir",
            str(work / "pack"),
        ]
    )
    if not (work / "pack" / "llama_index" / "packs" / "self_rag_rse" / "__init__.py").is_file():
        raise CheckFailed("download-llamapack left no package in its folder")
    print("command_line: --help and download-llamapack work")


def rse_pipeline() -> None:
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.node_parser import SentenceSplitter

    from llama_index.packs.self_rag_rse import RelevantSegmentPostprocessor

    text = " ".join(f"Sentence {i} says that the answer is number {i}." for i in range(60))
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=0).get_nodes_from_documents(
        [Document(text=text, doc_id="doc")]
    )
    index = VectorStoreIndex(nodes, embed_model=MockEmbedding(embed_dim=8))
    retriever = index.as_retriever(similarity_top_k=4)
    rse = RelevantSegmentPostprocessor(docstore=index.docstore)
    hits = retriever.retrieve("answer")
    out = rse.postprocess_nodes(hits, query_str="answer")
    if not out or not all(n.node.get_content() for n in out):
        raise CheckFailed(f"the RSE pipeline returned {out!r}")
    print(f"rse_pipeline: {len(hits)} hits -> {len(out)} nodes")


def inside(work: Path) -> None:
    public_names()
    command_line(work)
    rse_pipeline()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inside", metavar="WORK", help=argparse.SUPPRESS)
    parser.add_argument("--keep", metavar="DIR", help="build in DIR and keep it")
    args = parser.parse_args()
    try:
        if args.inside:
            inside(Path(args.inside))
            return 0
        declared_imports()
        with tempfile.TemporaryDirectory(prefix="check-install-") as tmp:
            work = Path(args.keep or tmp)
            work.mkdir(parents=True, exist_ok=True)
            wheel = build_wheel(work / "wheel")
            python = fresh_venv(work / "venv", wheel)
            # Run from the work folder so the checkout is not on sys.path.
            run([str(python), str(Path(__file__).resolve()), "--inside", str(work)], cwd=work)
    except CheckFailed as error:
        print(f"check_install: FAILED: {error}", file=sys.stderr)
        return 1
    print("check_install: the bare install works")
    return 0


if __name__ == "__main__":
    sys.exit(main())
