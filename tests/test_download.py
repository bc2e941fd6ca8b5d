"""``download_llama_pack`` and ``self-rag-rse download-llamapack``: copy the pack, run the copy."""

from __future__ import annotations

import importlib
import inspect
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

from llama_index.packs.self_rag_rse import download, download_llama_pack
from llama_index.packs.self_rag_rse.cli import main
from llama_index.packs.self_rag_rse.download import (
    PACKAGE,
    PACKAGE_PATH,
    copy_pack,
    find_source,
    install_missing_requirements,
    missing_requirements,
)

REPO = Path(__file__).resolve().parents[1]
INSTALLED_PACKAGE = Path(download.__file__).resolve().parent
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")
CORE_SIGNATURE = ["llama_pack_class", "download_dir", "llama_pack_url", "refresh_cache"]


def _run(
    args: list[str], cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run this Python in ``cwd``: ``python -c`` puts the working folder first on sys.path, and
    the repository root there would shadow the copy.
    """
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
        check=False,
    )


def _own_modules() -> list[str]:
    return [k for k in sys.modules if k == PACKAGE or k.startswith(PACKAGE + ".")]


@pytest.fixture
def restore_imports() -> Iterator[None]:
    """Give back the installed package after a test imported the copy in this process."""
    saved = {k: sys.modules[k] for k in _own_modules()}
    saved_path = list(sys.path)
    packs = sys.modules["llama_index.packs"]
    yield
    for key in _own_modules():
        del sys.modules[key]
    sys.modules.update(saved)
    packs.self_rag_rse = saved[PACKAGE]  # type: ignore[attr-defined]
    sys.path[:] = saved_path
    importlib.invalidate_caches()


# -- end to end: the command copies, the copy answers ---------------------------------------------

RUN_THE_COPY = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.schema import NodeWithScore, TextNode

    from llama_index.packs.self_rag_rse import SelfRAGPack, SelfRAGQueryEngine

    class FixedRetriever(BaseRetriever):
        def _retrieve(self, query_bundle):
            texts = ["The while statement repeats a suite.", "The for statement iterates."]
            return [NodeWithScore(node=TextNode(text=t), score=0.5) for t in texts]

    options = {"model_kwargs": {"n_ctx": 1024, "n_threads": 1}, "mode": "always_retrieve",
               "max_new_tokens": 8}
    pack = SelfRAGPack(sys.argv[1], FixedRetriever(), **options)
    response = pack.run("What does the while statement do?")
    engine_module = sys.modules[SelfRAGQueryEngine.__module__]
    print(json.dumps({
        "pack_file": sys.modules[SelfRAGPack.__module__].__file__,
        "engine_file": engine_module.__file__,
        "edited": getattr(engine_module, "EDITED_IN_THE_COPY", False),
        "answer": str(response.response),
        "critic": response.metadata["self_rag"]["critic"],
        "paragraphs": len(response.metadata["self_rag"]["paragraphs"]),
    }))
    getattr(pack.query_engine, "close", lambda: None)()  # frees the model it loaded
    """
)


def test_cli_copies_a_project_whose_pack_answers_offline(tmp_path, tiny_gguf_paths):
    dest = tmp_path / "pack"
    command = ["-m", PACKAGE, "download-llamapack", "SelfRAGPack", "--download-dir", str(dest)]
    done = _run(command, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "pip install -e" in done.stdout

    # A self-contained project: the package folder, without caches, and its project files.
    for name in PROJECT_FILES:
        assert (dest / name).read_bytes() == (REPO / name).read_bytes()
    copied = {p.relative_to(dest / PACKAGE_PATH) for p in (dest / PACKAGE_PATH).rglob("*.py")}
    source = {p.relative_to(INSTALLED_PACKAGE) for p in INSTALLED_PACKAGE.rglob("*.py")}
    assert copied == source
    assert not list(dest.rglob("__pycache__")) and not (dest / PACKAGE_PATH / "_project").exists()

    # Edit the copy: the copy's internals, not the installed ones, must run.
    engine_file = dest / PACKAGE_PATH / "self_rag" / "engine.py"
    engine_file.write_text(engine_file.read_text() + "\nEDITED_IN_THE_COPY = True\n")
    env = {**os.environ, "PYTHONPATH": str(dest), "HF_HUB_OFFLINE": "1"}
    ran = _run(
        ["-c", RUN_THE_COPY, str(tiny_gguf_paths["user_defined"])],
        cwd=tmp_path,
        env=env,
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    assert Path(result["pack_file"]).is_relative_to(dest)
    assert Path(result["engine_file"]) == engine_file and result["edited"] is True
    assert result["critic"] == "reflection" and result["paragraphs"] == 2
    assert isinstance(result["answer"], str) and result["answer"]


def test_download_llama_pack_returns_the_class_from_the_copy(tmp_path, restore_imports):
    installed = importlib.import_module(PACKAGE).ChunkIndexer
    dest = tmp_path / "pack"
    cls = download_llama_pack("ChunkIndexer", str(dest), install_requirements=False)
    assert cls.__name__ == "ChunkIndexer" and cls is not installed
    assert Path(inspect.getfile(cls)).resolve().is_relative_to(dest.resolve())
    # The whole package now resolves to the copy, lazily imported internals included.
    engine = importlib.import_module(f"{PACKAGE}.self_rag.engine")
    assert Path(engine.__file__ or "").resolve().is_relative_to(dest.resolve())
    pack = download_llama_pack("SelfRAGPack", dest, refresh_cache=False)
    assert Path(inspect.getfile(pack)).resolve().is_relative_to(dest.resolve())


def test_without_download_dir_the_installed_class_comes_back():
    package = importlib.import_module(PACKAGE)
    assert (
        download_llama_pack("RelevantSegmentPostprocessor") is package.RelevantSegmentPostprocessor
    )


def test_exported_from_the_package_with_cores_signature():
    from llama_index.packs.self_rag_rse import download_llama_pack as exported

    assert exported is download_llama_pack
    params = list(inspect.signature(download_llama_pack).parameters)
    assert params[: len(CORE_SIGNATURE)] == CORE_SIGNATURE
    try:  # core <= 0.14.20 still has its own: same positional parameters
        from llama_index.core.llama_pack import download_llama_pack as core_download
    except ImportError:
        return
    assert list(inspect.signature(core_download).parameters) == CORE_SIGNATURE


def test_pack_is_a_core_llama_pack_where_core_has_one():
    pack = importlib.import_module(PACKAGE).SelfRAGPack
    try:
        from llama_index.core.llama_pack import BaseLlamaPack
    except ImportError:  # core >= 0.14.21: the pack carries a stand-in with the same contract
        assert {"get_modules", "run"} <= set(dir(pack))
        return
    assert issubclass(pack, BaseLlamaPack)


# -- names ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "SelfRAGPack",
        "SelfRAGQueryEngine",
        "RelevantSegmentPostprocessor",
        "ChunkIndexer",
        "PromptedCritic",
        "ReflectionCritic",
    ],
)
def test_public_components_are_accepted(name):
    assert name in download.public_names()


def test_a_bad_name_lists_the_valid_ones_and_the_closest(tmp_path):
    with pytest.raises(
        ValueError, match=r"'SelfRagPack'.*did you mean 'SelfRAGPack'.*ChunkIndexer"
    ):
        download_llama_pack("SelfRagPack", tmp_path / "pack")
    with pytest.raises(ValueError, match="Other packs are not served here"):
        download_llama_pack("GmailOpenAIAgentPack", tmp_path / "pack")
    assert not (tmp_path / "pack").exists()
    assert "download_llama_pack" not in download.public_names()


# -- folders --------------------------------------------------------------------------------------


def test_a_non_empty_folder_is_never_silently_overwritten(tmp_path):
    source = find_source()
    dest = tmp_path / "project"
    dest.mkdir()
    (dest / "pyproject.toml").write_text("[project]\nname = 'mine'\n")
    with pytest.raises(FileExistsError, match=r"not empty.*pyproject.toml.*overwrite"):
        copy_pack(source, dest)
    # --overwrite replaces the package folder whole: the refusal said "other files are kept",
    # and a module the user had added there was gone.
    with pytest.raises(FileExistsError, match=r"self_rag_rse/ whole \(files you added in it go"):
        copy_pack(source, dest)
    assert (dest / "pyproject.toml").read_text() == "[project]\nname = 'mine'\n"
    assert sorted(p.name for p in dest.iterdir()) == ["pyproject.toml"]

    fresh = tmp_path / "pack"
    assert copy_pack(source, fresh) is True
    assert copy_pack(source, fresh) is False  # an identical copy: nothing to write, no error
    readme = fresh / "README.md"
    readme.write_text("my notes")
    with pytest.raises(FileExistsError, match=r"README.md.*use-existing"):
        copy_pack(source, fresh)
    assert copy_pack(source, fresh, refresh_cache=False) is False
    assert readme.read_text() == "my notes"
    stale = fresh / PACKAGE_PATH / "stale_module.py"
    stale.write_text("")
    (fresh / "notes.txt").write_text("kept")
    assert copy_pack(source, fresh, overwrite=True) is True
    assert readme.read_bytes() == (REPO / "README.md").read_bytes()
    assert not stale.exists() and (fresh / "notes.txt").read_text() == "kept"


def test_overwrite_never_writes_through_a_hard_link(tmp_path, capsys, restore_imports):
    """A ``cp -al`` backup shares every file of the folder: --overwrite rewrote the pack's files
    in place, so the backup, outside the folder, changed with them.
    """
    dest = tmp_path / "pack"
    assert copy_pack(find_source(), dest) is True
    (dest / "README.md").write_text("my notes")
    (dest / PACKAGE_PATH / "pack.py").write_text("# my edit")
    backup = tmp_path / "backup"
    backup.mkdir()
    for path in sorted(dest.rglob("*")):
        copied = backup / path.relative_to(dest)
        if path.is_dir():
            copied.mkdir(parents=True)
        else:
            os.link(path, copied)  # what ``cp -al pack backup`` does
    before = _tree(backup)
    argv = ["download-llamapack", "ChunkIndexer", "-d", str(dest), "--no-install", "--overwrite"]
    assert main(argv) == 0, capsys.readouterr().err
    assert _tree(backup) == before
    assert (dest / "README.md").read_bytes() == (REPO / "README.md").read_bytes()
    assert (dest / PACKAGE_PATH / "pack.py").read_bytes() == (
        INSTALLED_PACKAGE / "pack.py"
    ).read_bytes()
    assert not [path.name for path in dest.rglob("*.partial")]


def test_overwrite_with_use_existing_is_an_error_and_writes_nothing(tmp_path, capsys):
    """The two flags contradict each other: --use-existing won and --overwrite was ignored."""
    fresh = tmp_path / "pack"
    assert copy_pack(find_source(), fresh) is True
    (fresh / "README.md").write_text("my notes")
    with pytest.raises(ValueError, match="pass one of them"):
        copy_pack(find_source(), fresh, refresh_cache=False, overwrite=True)
    argv = ["download-llamapack", "ChunkIndexer", "-d", str(fresh), "--no-install"]
    assert main([*argv, "--overwrite", "--use-existing"]) == 1
    assert "--overwrite) replaces the copy" in capsys.readouterr().err
    assert (fresh / "README.md").read_text() == "my notes"


def test_cli_reports_a_used_folder_and_exits_1(tmp_path, capsys):
    (tmp_path / "data.csv").write_text("1,2\n")
    status = main(["download-llamapack", "ChunkIndexer", "-d", str(tmp_path), "--no-install"])
    assert status == 1
    assert "not empty" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["data.csv"]


def _tree(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.parametrize(
    "link",
    ["llama_index", "llama_index/packs", f"{PACKAGE_PATH.as_posix()}/rse", "README.md"],
)
@pytest.mark.parametrize("mode", ["overwrite", "refresh", "use-existing"])
def test_symlinks_inside_the_folder_are_refused_before_anything_is_written(tmp_path, link, mode):
    source = find_source()
    # A copy that lives elsewhere, reached through a link inside the download folder.
    elsewhere = tmp_path / "elsewhere"
    copy_pack(source, elsewhere)
    dest = tmp_path / "pack"
    copy_pack(source, dest)
    target = dest / link
    if target.is_dir():
        shutil.rmtree(target)
    else:
        target.unlink()
    target.symlink_to(elsewhere / link)
    (elsewhere / "README.md").write_text("someone else's file")
    before_elsewhere, before_dest = _tree(elsewhere), _tree(dest)
    options = {
        "overwrite": {"overwrite": True},
        "refresh": {},
        "use-existing": {"refresh_cache": False},
    }[mode]
    with pytest.raises(ValueError, match=rf"symbolic link.*{link}.*elsewhere.*nothing was written"):
        copy_pack(source, dest, **options)
    assert _tree(elsewhere) == before_elsewhere and _tree(dest) == before_dest


def test_cli_refuses_a_symlinked_package_folder_and_writes_nothing(
    tmp_path, capsys, restore_imports
):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "pack"
    dest.mkdir()
    (dest / "llama_index").symlink_to(elsewhere)
    status = main(
        ["download-llamapack", "ChunkIndexer", "-d", str(dest), "--overwrite", "--no-install"]
    )
    err = capsys.readouterr().err
    assert status == 1
    assert "symbolic link" in err and str(dest / "llama_index") in err
    assert "not from the copy" not in err
    assert list(elsewhere.iterdir()) == []


def test_a_download_folder_that_is_itself_a_link_is_fine(tmp_path, restore_imports):
    real = tmp_path / "real"
    real.mkdir()
    dest = tmp_path / "link"
    dest.symlink_to(real, target_is_directory=True)
    cls = download_llama_pack("ChunkIndexer", str(dest), install_requirements=False)
    assert Path(inspect.getfile(cls)).resolve().is_relative_to(real)


def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() != 0:
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        read_only.chmod(0o500)
        return read_only / "pack"
    # Root ignores permission bits; sysfs refuses new folders to everyone.
    return Path("/sys/self-rag-rse-pack")


def test_unwritable_folders_get_clear_errors(tmp_path):
    with pytest.raises(PermissionError, match=r"Cannot create download_dir .*Pick a folder"):
        copy_pack(find_source(), _unwritable(tmp_path))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    with pytest.raises(NotADirectoryError, match="is a file"):
        copy_pack(find_source(), a_file)
    with pytest.raises(NotADirectoryError, match="Cannot create download_dir"):
        copy_pack(find_source(), a_file / "pack")


def test_the_source_itself_is_refused():
    with pytest.raises(ValueError, match="own source"):
        copy_pack(find_source(), INSTALLED_PACKAGE.parents[2])


# -- sources --------------------------------------------------------------------------------------


def test_copy_from_a_checkout_and_refuse_remote_urls(tmp_path):
    for url in (str(REPO), REPO.as_uri()):
        source = find_source(url)
        assert source.package_dir == REPO / PACKAGE_PATH
        assert source.project_files["LICENSE"] == REPO / "LICENSE"
    with pytest.raises(ValueError, match=r"remote.*works offline"):
        find_source(
            "https://raw.githubusercontent.com/run-llama/llama_index/main/llama-index-packs"
        )
    with pytest.raises(ValueError, match=r"pyproject\.toml"):
        find_source(tmp_path)


def test_a_wheel_install_is_copied_from_its_bundled_project_files(tmp_path):
    # The layout a wheel install has: no repository root, project files in ``_project/``.
    site = tmp_path / "site"
    bundled = site / PACKAGE_PATH / "_project"
    shutil.copytree(
        INSTALLED_PACKAGE, site / PACKAGE_PATH, ignore=shutil.ignore_patterns("__pycache__")
    )
    bundled.mkdir()
    for name in PROJECT_FILES:
        shutil.copyfile(REPO / name, bundled / name)
    dest = tmp_path / "pack"
    script = (
        "import pathlib, sys\n"
        "from llama_index.packs.self_rag_rse.download import copy_pack, find_source\n"
        "source = find_source()\n"
        "print(source.project_files['LICENSE'])\n"
        "copy_pack(source, pathlib.Path(sys.argv[1]))\n"
    )
    done = _run(
        ["-c", script, str(dest)], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(site)}
    )
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()) == bundled / "LICENSE"
    assert (dest / "LICENSE").is_file() and not (dest / PACKAGE_PATH / "_project").exists()


def test_the_wheel_bundles_every_project_file():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    bundled = wheel["force-include"]
    for name in PROJECT_FILES:
        assert bundled[name] == f"{PACKAGE_PATH.as_posix()}/_project/{name}"
    assert "LICENSE" in pyproject["tool"]["hatch"]["build"]["targets"]["sdist"]["include"]
    assert pyproject["project"]["scripts"]["self-rag-rse"] == f"{PACKAGE}.cli:main"


# -- requirements ---------------------------------------------------------------------------------


def _pyproject(tmp_path: Path) -> Path:
    path = tmp_path / "pyproject.toml"
    path.write_text(
        textwrap.dedent(
            """
            [project]
            name = "llama-index-packs-self-rag-rse"
            dependencies = ["numpy>=1", "surely-not-installed-self-rag-rse-dep>=1"]
            [project.optional-dependencies]
            fast = ["numpy<1"]
            plot = ["another-missing-self-rag-rse-dep"]
            elsewhere = ["surely-not-installed-self-rag-rse-dep; sys_platform == 'no-such-os'"]
            all = ["llama-index-packs-self-rag-rse[fast,plot,elsewhere]"]
            """
        )
    )
    return path


def test_only_missing_requirements_are_named(tmp_path):
    pyproject = _pyproject(tmp_path)
    assert missing_requirements(pyproject) == ["surely-not-installed-self-rag-rse-dep>=1"]
    assert missing_requirements(pyproject, ["all"]) == [
        "surely-not-installed-self-rag-rse-dep>=1",
        "another-missing-self-rag-rse-dep",
        "numpy<1",
    ]
    # A marker that does not apply here needs nothing installed.
    assert missing_requirements(pyproject, ["elsewhere"]) == [
        "surely-not-installed-self-rag-rse-dep>=1"
    ]
    with pytest.raises(ValueError, match=r"Unknown extra 'gpu'; valid extras: all, elsewhere, fa"):
        missing_requirements(pyproject, ["gpu"])


def test_an_unreadable_requirement_names_itself(tmp_path):
    path = tmp_path / "pyproject.toml"
    path.write_text('[project]\nname = "x"\ndependencies = ["numpy >>> 1"]\n')
    with pytest.raises(ValueError, match=r"Cannot read the requirement 'numpy >>> 1'"):
        missing_requirements(path)


def test_pip_installs_only_what_is_missing(tmp_path, monkeypatch, caplog):
    pyproject = _pyproject(tmp_path)
    calls: list[list[str]] = []

    def fake_run(command: list[str], check: bool) -> subprocess.CompletedProcess[str]:
        calls.append(command)
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.setattr(download.subprocess, "run", fake_run)
    install_missing_requirements(pyproject)
    assert calls == [
        [sys.executable, "-m", "pip", "install", "surely-not-installed-self-rag-rse-dep>=1"]
    ]
    with caplog.at_level(logging.WARNING, logger=download.__name__):
        install_missing_requirements(pyproject, install=False)
    assert len(calls) == 1 and "pip install" in caplog.text

    monkeypatch.setattr(
        download.subprocess, "run", lambda command, check: subprocess.CompletedProcess(command, 1)
    )
    with pytest.raises(RuntimeError, match=r"pip could not install .*run:"):
        install_missing_requirements(pyproject)


# -- the command line -----------------------------------------------------------------------------


def test_help_explains_the_legacy_cli(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "download-llamapack" in text and "0.14.21" in text and "mappings.json" in text
    with pytest.raises(SystemExit):
        main(["download-llamapack", "--help"])
    assert "pip install -e DIR" in capsys.readouterr().out


def test_list_prints_the_accepted_names(capsys):
    assert main(["list"]) == 0
    assert capsys.readouterr().out.split() == download.public_names()


def test_a_damaged_pyproject_is_named(tmp_path):
    checkout = tmp_path / "checkout"
    (checkout / PACKAGE_PATH).mkdir(parents=True)
    (checkout / PACKAGE_PATH / "__init__.py").write_text("")
    (checkout / "pyproject.toml").write_text('[project]\nname = "llama-index-packs-self')
    with pytest.raises(ValueError, match=rf"{checkout / 'pyproject.toml'} is not valid TOML"):
        find_source(checkout)


@pytest.mark.parametrize("extra", ["", "gpu"])
def test_an_unknown_extra_is_refused_before_anything_is_written(tmp_path, capsys, extra):
    """The pack's files were copied first, then the extra was refused."""
    dest = tmp_path / "pack"
    argv = ["download-llamapack", "ChunkIndexer", "-d", str(dest), "--no-install"]
    assert main([*argv, "--extra", extra]) == 1
    assert f"Unknown extra {extra!r}; valid extras:" in capsys.readouterr().err
    assert not dest.exists()


def test_an_empty_download_dir_is_refused_naming_the_fix(tmp_path, monkeypatch, capsys):
    """It was the current folder, which --overwrite would have copied into."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"download_dir is empty.*folder name"):
        download_llama_pack("ChunkIndexer", "")
    argv = ["download-llamapack", "ChunkIndexer", "-d", "", "--no-install", "--overwrite"]
    assert main(argv) == 1
    assert "--download-dir" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
