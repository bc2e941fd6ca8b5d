"""Copy this pack's source into a folder of yours: core's ``download_llama_pack``, offline.

LlamaIndex users know packs from ``llamaindex-cli download-llamapack <Class> --download-dir DIR``
and ``download_llama_pack(...)``: the pack's source lands in their project, to read and edit. That
flow cannot serve this pack. ``llama-index-core`` 0.14.21 removed ``llama_index.core.llama_pack``
and ``llama_index.core.download``, so ``llama-index-cli`` 0.5.7 dies at import. Cores up to
0.14.20 map the class name through their bundled ``mappings.json``, where ``SelfRAGPack`` is the
upstream ``llama-index-packs-self-rag`` (the wrong pack), and list files from the run-llama GitHub
tree whatever URL is given.

So the pack downloads itself: the source is copied from the installed package (or a local
checkout), nothing is fetched, and any 0.14.x core works. The copy is a self-contained project
(pyproject, README, LICENSE, CHANGELOG and the whole package folder) that ``pip install -e DIR``
turns into the running pack. A wheel install carries those project files inside the package, in
``_project/`` (see ``[tool.hatch.build.targets.wheel.force-include]``); a source or editable
install has them at the repository root. The command line is in :mod:`.cli`.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # declared for Python 3.10 as tomli
    import tomli as tomllib

logger = logging.getLogger(__name__)

#: Import name and distribution name of this pack (a copy keeps both).
PACKAGE = "llama_index.packs.self_rag_rse"
DISTRIBUTION = "llama-index-packs-self-rag-rse"
#: Where the package lives inside a project (and inside a download folder).
PACKAGE_PATH = Path("llama_index", "packs", "self_rag_rse")
#: Project files copied beside ``llama_index/``; the optional ones are skipped when absent.
REQUIRED_PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")
OPTIONAL_PROJECT_FILES = ("CHANGELOG.md",)
#: Folder inside the installed package where a wheel ships the project files.
BUNDLED_PROJECT_DIR = "_project"

_IGNORED_NAMES = {"__pycache__", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
_IGNORED_SUFFIXES = (".pyc", ".pyo")


@dataclass(frozen=True)
class PackSource:
    """Where a copy of the pack is read from: its package folder and its project files."""

    package_dir: Path
    project_files: dict[str, Path]

    def plan(self) -> dict[Path, Path]:
        """Every file of the copy: destination path relative to the download folder → source."""
        files: dict[Path, Path] = {Path(name): path for name, path in self.project_files.items()}
        for path in sorted(self.package_dir.rglob("*")):
            rel = path.relative_to(self.package_dir)
            if rel.parts[0] == BUNDLED_PROJECT_DIR or _ignored(rel) or not path.is_file():
                continue
            files[PACKAGE_PATH / rel] = path
        return files


def public_names() -> list[str]:
    """The names ``download_llama_pack`` accepts: the classes in the package's ``__all__``.

    Read at run time; a class is told by its CapWords name, so nothing else gets imported
    (functions, constants and ``download_llama_pack`` itself are not components).
    """
    names = getattr(importlib.import_module(PACKAGE), "__all__", ())
    return sorted(n for n in names if n[:1].isupper() and not n.isupper())


def download_llama_pack(
    llama_pack_class: str,
    download_dir: str | os.PathLike[str] | None = None,
    llama_pack_url: str | os.PathLike[str] | None = None,
    refresh_cache: bool = True,
    *,
    overwrite: bool = False,
    install_requirements: bool = True,
    extras: Sequence[str] = (),
) -> Any:
    """Copy this pack's source into ``download_dir`` and return the named class from the copy.

    Same signature as ``llama_index.core.llama_pack.download_llama_pack`` (core ≤ 0.14.20), so
    existing code changes one import line. Nothing is fetched from the network.

    Args:
        llama_pack_class: A public name of this package: ``"SelfRAGPack"``,
            ``"SelfRAGQueryEngine"``, ``"RelevantSegmentPostprocessor"``, ``"ChunkIndexer"``,
            ``"PromptedCritic"``, ``"ReflectionCritic"``, ... (any class in its ``__all__``).
            Another name raises ``ValueError`` listing the valid ones and the closest match.
        download_dir: Folder to copy into; created if missing. It receives a self-contained
            project (``pyproject.toml``, ``README.md``, ``LICENSE``, ``CHANGELOG.md`` and
            ``llama_index/packs/self_rag_rse/``) that ``pip install -e download_dir`` installs.
            ``None``: copy nothing and return the installed class (core installs the pack from
            PyPI in that case; here it is installed already, so only ``extras`` are checked).
        llama_pack_url: Where to copy from. ``None`` (default): the installed package. Otherwise
            a local path or ``file://`` URL of a checkout of this project (its root, holding
            ``pyproject.toml``). Remote URLs are refused: this function works offline.
        refresh_cache: As in core, ``False`` reuses a copy already in ``download_dir`` as it is
            (your edits kept). ``True`` (default) copies; a folder holding an identical copy is
            left as it is.
        overwrite: A non-empty ``download_dir`` that is not an identical copy is never written
            to unless this is ``True``; then the previous copy's package folder is removed and the
            project files are replaced (other files in the folder are kept). Every file is
            written anew and renamed into place, never written into: a hard link to an old file
            (a ``cp -al`` backup) keeps its content.
        install_requirements: Core pip-installs the pack's requirements. Here only the
            requirements of the copy (plus ``extras``) that the running environment does not
            satisfy are installed, with ``python -m pip install <requirement>...`` (your pip
            configuration applies, so a local index or wheel folder works offline); installed
            packages are never upgraded or reinstalled. ``False`` installs nothing and logs the
            command to run. The copy itself is not installed: ``pip install -e download_dir``
            would replace the installed ``llama-index-packs-self-rag-rse`` (same distribution).
        extras: Optional-dependency groups of the copy's ``pyproject.toml`` to satisfy too, e.g.
            ``("llama-cpp",)`` (building llama-cpp-python needs ``CMAKE_ARGS``: see the README).

    Returns:
        The object named ``llama_pack_class``. With ``download_dir`` it comes from the copy: this
        process then imports ``llama_index.packs.self_rag_rse`` from ``download_dir``, as if the
        copy were installed. The copy shares the installed package's import name and imports its
        own modules absolutely, so loading one file of it under another name (as core does) would
        run the installed internals, not your edits. Instead every module under
        ``llama_index.packs.self_rag_rse`` is dropped from ``sys.modules``, ``download_dir`` is put
        first on ``sys.path`` (it stays there, so child processes resolve the same copy) and the
        package is imported again. Objects created before from the installed package keep their
        old classes. To leave a process untouched, run the copy in another one
        (``PYTHONPATH=download_dir``).

    Raises:
        ValueError: unknown name, unknown extra, remote or damaged ``llama_pack_url``,
            ``download_dir=""`` or the pack's own source, ``overwrite`` with
            ``refresh_cache=False``, or symlinks inside ``download_dir`` where the copy goes
            (checked before anything is written).
        FileExistsError: ``download_dir`` is not empty and holds no identical copy.
        PermissionError / NotADirectoryError: ``download_dir`` cannot be created or written.
        RuntimeError: pip failed to install a missing requirement.
        ImportError: the copy could not be imported in place of the installed package.
    """
    name = _check_name(llama_pack_class)
    if download_dir is not None and not os.fspath(download_dir):  # Path("") is the working folder
        raise ValueError(
            "download_dir is empty (CLI: --download-dir ''); pass a folder name, "
            "e.g. --download-dir ./self_rag_rse_pack"
        )
    if download_dir is None:
        # The installed pack's own requirements are met (pip installed them); extras may not be.
        if extras:
            pyproject = find_source(llama_pack_url).project_files["pyproject.toml"]
            install_missing_requirements(pyproject, extras, install=install_requirements)
        return getattr(importlib.import_module(PACKAGE), name)

    source = find_source(llama_pack_url)
    missing_requirements(source.project_files["pyproject.toml"], extras)  # unknown extras raise
    dest = Path(download_dir).expanduser().absolute()
    copy_pack(source, dest, refresh_cache=refresh_cache, overwrite=overwrite)
    install_missing_requirements(dest / "pyproject.toml", extras, install=install_requirements)
    return import_from_copy(dest, name)


def find_source(llama_pack_url: str | os.PathLike[str] | None = None) -> PackSource:
    """Locate the package folder and the project files to copy.

    ``None`` means the installed package: project files are read from its ``_project/`` folder
    (wheel installs) and then from the source tree root (editable and source installs).
    """
    if llama_pack_url is None:
        package_dir = Path(__file__).resolve().parent
        roots = [package_dir / BUNDLED_PROJECT_DIR, package_dir.parents[2]]
        origin = f"the installed package ({package_dir})"
    else:
        root = _local_path(llama_pack_url)
        package_dir = root / PACKAGE_PATH
        roots = [root]
        origin = str(root)
        if not (package_dir / "__init__.py").is_file():
            raise ValueError(
                f"{root} holds no {PACKAGE_PATH.as_posix()}/__init__.py; pass the root of a "
                f"checkout of {DISTRIBUTION} (the folder with its pyproject.toml)"
            )
    project_files: dict[str, Path] = {}
    for filename in REQUIRED_PROJECT_FILES + OPTIONAL_PROJECT_FILES:
        for root in roots:
            candidate = root / filename
            if candidate.is_file() and _belongs_to_pack(root):
                project_files[filename] = candidate
                break
    if missing := [f for f in REQUIRED_PROJECT_FILES if f not in project_files]:
        raise FileNotFoundError(
            f"Cannot copy a self-contained project from {origin}: {', '.join(missing)} not found "
            f"in {' or '.join(str(r) for r in roots)}. Install the pack from its repository or "
            f"from a wheel built with this release, or pass llama_pack_url=<checkout folder>."
        )
    return PackSource(package_dir=package_dir, project_files=project_files)


def copy_pack(
    source: PackSource, dest: Path, *, refresh_cache: bool = True, overwrite: bool = False
) -> bool:
    """Copy ``source`` into ``dest``; return whether any file was written.

    See :func:`download_llama_pack` for ``refresh_cache`` and ``overwrite``. Before writing, the
    folder is checked: never the pack's own source, never a symbolic link inside it on the way
    to a file of the copy (``dest`` itself may be one), never a non-empty folder that would
    change unless ``overwrite``.
    """
    if overwrite and not refresh_cache:
        raise ValueError(
            "overwrite=True (CLI: --overwrite) replaces the copy in download_dir and "
            "refresh_cache=False (CLI: --use-existing) keeps it as it is: pass one of them"
        )
    plan = source.plan()
    own_package = source.package_dir.resolve()
    if (dest / PACKAGE_PATH).resolve() == own_package or dest.resolve().is_relative_to(own_package):
        raise ValueError(
            f"download_dir {dest} is the pack's own source ({source.package_dir}); "
            "pick a folder outside it, e.g. --download-dir ./self_rag_rse_pack"
        )
    _refuse_symlinks(dest, plan)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(
            f"download_dir {dest} is a file, not a folder; pick a new folder name"
        )
    existing = sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []
    has_copy = (dest / PACKAGE_PATH / "__init__.py").is_file()
    if existing and has_copy and not refresh_cache:
        logger.info("Using the copy already in %s as it is (refresh_cache=False)", dest)
        return False
    if existing and not overwrite:
        changed = [
            rel.as_posix()
            for rel, src in plan.items()
            if not (dest / rel).is_file() or (dest / rel).read_bytes() != src.read_bytes()
        ]
        if not changed:
            logger.info("%s already holds an identical copy of the pack", dest)
            return False
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        reuse = ", pass refresh_cache=False (CLI: --use-existing) to use the copy there as it is"
        raise FileExistsError(
            f"download_dir {dest} is not empty (it holds {', '.join(existing[:5])}"
            f"{' ...' if len(existing) > 5 else ''}) and copying would change "
            f"{', '.join(changed[:5])}{more}; nothing was written. Pick a new or empty "
            f"folder{reuse if has_copy else ''}, or pass overwrite=True "
            f"(CLI: --overwrite) to replace the pack's files there: {PACKAGE_PATH.as_posix()}/ "
            "whole (files you added in it go too); other files are kept."
        )
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise type(error)(
            error.errno,
            f"Cannot create download_dir {dest}: {error.strerror}. Pick a folder you can write "
            "to, e.g. --download-dir ./self_rag_rse_pack",
        ) from error
    if not os.access(dest, os.W_OK | os.X_OK):
        raise PermissionError(
            f"download_dir {dest} is not writable; pick a folder you can write to, or change its "
            "permissions"
        )
    if overwrite and has_copy:
        shutil.rmtree(dest / PACKAGE_PATH)
    try:
        for rel, src in plan.items():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            _replace_file(src, dest / rel)
    except OSError:
        if not existing:  # leave no half copy behind in a folder we created or found empty
            for child in dest.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink()
        raise
    logger.info("Copied %d files of %s into %s", len(plan), DISTRIBUTION, dest)
    return True


def import_from_copy(dest: Path, name: str) -> Any:
    """Import ``llama_index.packs.self_rag_rse`` from the copy in ``dest`` and return ``name``.

    See :func:`download_llama_pack` (Returns) for what this does to the running process.
    """
    dest = dest.absolute()
    for key in [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]:
        del sys.modules[key]
    if str(dest) in sys.path:
        sys.path.remove(str(dest))
    sys.path.insert(0, str(dest))
    importlib.invalidate_caches()
    # ``llama_index`` and ``llama_index.packs`` are namespace packages: their ``__path__``
    # recomputes from sys.path, so the copy's portion now comes first. Guard against a
    # regular-package ``llama_index.packs`` (a frozen list) all the same.
    packs = importlib.import_module("llama_index.packs")
    portion = str(dest / "llama_index" / "packs")
    if isinstance(packs.__path__, list) and portion not in packs.__path__:
        packs.__path__.insert(0, portion)
    package = importlib.import_module(PACKAGE)
    loaded = Path(package.__file__ or "").resolve()
    if not loaded.is_relative_to(dest.resolve()):
        raise ImportError(
            f"{PACKAGE} was imported from {loaded}, not from the copy in {dest}; run the copy in "
            f"a new process with PYTHONPATH={dest} or install it with pip install -e {dest}"
        )
    logger.info("%s now loads from %s", PACKAGE, dest)
    return getattr(package, name)


def missing_requirements(pyproject: Path, extras: Sequence[str] = ()) -> list[str]:
    """Requirements of ``pyproject`` (and its ``extras``) the running environment lacks."""
    project = _read_toml(pyproject).get("project", {})
    groups: dict[str, list[str]] = project.get("optional-dependencies", {})
    if unknown := [e for e in extras if e not in groups]:
        raise ValueError(
            f"Unknown extra {', '.join(map(repr, unknown))}; "
            f"valid extras: {', '.join(sorted(groups))}"
        )
    requirements = list(project.get("dependencies", []))
    pending = list(extras)
    seen: set[str] = set()
    while pending:  # ``all = ["<this distribution>[a,b]"]`` names other extras: expand them
        extra = pending.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in groups.get(extra, []):
            parsed = _requirement(req)
            if canonicalize_name(parsed.name) == canonicalize_name(DISTRIBUTION):
                pending.extend(sorted(parsed.extras))  # a set: sorted, so pip's order is stable
            else:
                requirements.append(req)
    return [req for req in dict.fromkeys(requirements) if not _satisfied(req)]


# -- helpers -----------------------------------------------------------------------------------


def _check_name(name: str) -> str:
    valid = public_names()
    if name in valid:
        return name
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"{name!r} is not a public name of {DISTRIBUTION}{hint}; valid names: "
        f"{', '.join(valid)}. Other packs are not served here (see the README)."
    )


def _ignored(rel: Path) -> bool:
    return any(part in _IGNORED_NAMES for part in rel.parts) or rel.suffix in _IGNORED_SUFFIXES


def _local_path(url: str | os.PathLike[str]) -> Path:
    text = os.fspath(url)
    if text.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return Path(unquote(urlparse(text).path))
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]+://", text):
        raise ValueError(
            f"llama_pack_url={text!r} is remote; this download works offline. Clone or unpack "
            "the project and pass its folder (or a file:// URL), or leave it None for the "
            "installed pack"
        )
    return Path(text).expanduser().absolute()


def _belongs_to_pack(root: Path) -> bool:
    """Whether project files in ``root`` are this pack's (not some other project's root)."""
    if root.name == BUNDLED_PROJECT_DIR:
        return True
    pyproject = root / "pyproject.toml"
    if not pyproject.is_file():
        return False
    name = _read_toml(pyproject).get("project", {}).get("name", "")
    return bool(canonicalize_name(name) == canonicalize_name(DISTRIBUTION))


def _replace_file(src: Path, target: Path) -> None:
    """Copy ``src`` to ``target`` as a new file, renamed over the old one.

    Copying into the old file would write through every hard link to it: a ``cp -al`` backup
    of the folder, outside it, would change too. A file renamed into place leaves the old one,
    and its other names, as they were.
    """
    partial = target.with_name(f".{target.name}.partial")
    try:
        shutil.copyfile(src, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def _refuse_symlinks(dest: Path, plan: dict[Path, Path]) -> None:
    """Raise when a symbolic link inside ``dest`` lies on the way to a file of the copy.

    Writing through one would change files outside ``dest`` (overwrite would even delete them),
    and the copy would then load from outside ``dest``; comparing through one would take another
    folder's files for an identical copy. So: refused before anything is read or written.
    """
    linked: dict[Path, bool] = {}  # every prefix checked once
    for rel in plan:
        for depth in range(1, len(rel.parts) + 1):
            part = Path(*rel.parts[:depth])
            if part not in linked:
                linked[part] = (dest / part).is_symlink()
            if linked[part]:
                break  # what lies beyond is another folder's business
    if links := [dest / part for part, is_link in linked.items() if is_link]:
        shown = ", ".join(f"{link} -> {os.readlink(link)}" for link in links[:5])
        more = f" and {len(links) - 5} more" if len(links) > 5 else ""
        raise ValueError(
            f"download_dir {dest} holds symlinks (symbolic links) where the copy goes: "
            f"{shown}{more}. "
            "Copying through them would write outside the folder, and the copy would not load "
            f"from {dest}; nothing was written. Remove the links, or pick a new folder (the "
            "folder itself may be a link)."
        )


def install_missing_requirements(
    pyproject: Path, extras: Sequence[str] = (), *, install: bool = True
) -> list[str]:
    """Pip-install the requirements of ``pyproject`` (and ``extras``) this environment lacks.

    Satisfied requirements are left alone (nothing is upgraded or reinstalled). With
    ``install=False`` the pip command is only logged. Returns the missing requirements.
    """
    missing = missing_requirements(pyproject, extras)
    if not missing:
        return missing
    command = [sys.executable, "-m", "pip", "install", *missing]
    # Quoted where a shell would read the part otherwise (a requirement with ">" or "[").
    shown = " ".join(part if re.fullmatch(r"[\w./=-]+", part) else f'"{part}"' for part in command)
    if not install:
        logger.warning("The pack needs requirements this environment lacks; run: %s", shown)
        return missing
    logger.info("Installing missing requirements: %s", shown)
    result = subprocess.run(command, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"pip could not install {', '.join(missing)} (exit status {result.returncode}). "
            f"Fix the cause pip printed and run: {shown}  (llama-cpp-python builds from source: "
            "set CMAKE_ARGS as the README says)"
        )
    return missing


def _read_toml(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        try:
            return tomllib.load(handle)
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"{path} is not valid TOML ({error}); fix or restore it") from error


def _requirement(req: str) -> Requirement:
    try:
        return Requirement(req)
    except InvalidRequirement as error:
        raise ValueError(
            f"Cannot read the requirement {req!r} in pyproject.toml ({error}); fix or restore it"
        ) from error


def _satisfied(req: str) -> bool:
    """Whether the running environment satisfies ``req`` (version and marker included)."""
    parsed = _requirement(req)
    if parsed.marker is not None and not parsed.marker.evaluate():
        return True
    try:
        version = metadata.version(parsed.name)
    except metadata.PackageNotFoundError:
        return False
    return parsed.specifier.contains(version, prereleases=True)
