"""Build llama.cpp's ``llama-server`` once per machine, for the served-model tests and benchmark.

``make llama-server`` runs this script with the virtualenv's Python, because the script reads the
llama-cpp-python installed there. The Makefile holds the settings and passes them in the
environment (override them on make's command line, e.g. ``make llama-server LLAMA_SERVER_JOBS=8``):

  LLAMA_SERVER_CACHE       the cache folder: one subfolder per llama-cpp-python version
  LLAMA_SERVER_JOBS        how many compile jobs run in parallel
  LLAMA_SERVER_CMAKE_ARGS  CMake options for the server build (static, no curl or OpenSSL, no UI)
  CMAKE_ARGS               the CPU flags that llama-cpp-python was built with (portable AVX2)

The steps:

1. ``find_installed``: the version of llama-cpp-python and the folder of its shared libraries.
   If ``$LLAMA_SERVER_CACHE/<version>/llama-server`` exists, print its path and stop: the usual
   case takes seconds.
2. ``download_sources``: the llama-cpp-python sdist of that version. It includes the llama.cpp
   sources that the installed bindings were built from.
3. ``build_linking_prebuilt`` (the fast path, about 11 minutes on 2 cores): patch llama.cpp's
   CMake files so that ggml, libllama and libmtmd are imported targets, pointing at the
   libraries that llama-cpp-python already built (``scripts/llama_server_prebuilt.cmake``). Then
   compile only llama.cpp's common library and the server. The server runs the very code that
   the in-process critic runs. Its libraries are copied next to it (it finds them via an
   ``$ORIGIN`` rpath).
4. ``build_in_full`` (the fallback, about 21 minutes): used when any step of the fast path fails.
   It compiles llama.cpp from an unpatched copy of the sources.
5. ``check_runs`` and ``install``: the binary must answer ``--version``. It is then copied under
   a temporary name and renamed into the cache, so an interrupted build never leaves a binary
   that step 1 would accept.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

PREBUILT_CMAKE = Path(__file__).with_name("llama_server_prebuilt.cmake")
TARGET = "llama-server"


class StepFailed(Exception):
    """A build step failed. The message names the step and why it failed."""


@dataclass(frozen=True)
class Settings:
    """The build settings, read from the environment that the Makefile exports."""

    cache: Path
    jobs: str
    cmake_args: list[str]


def say(message: str) -> None:
    # Flushed, so the messages stay in order with cmake's output when make pipes them.
    print(message, flush=True)


def run_step(
    step: str, command: list[str], stdout: IO[str] | None = None, stderr: int | None = None
) -> None:
    """Run one command of the build. Output goes to the terminal unless redirected.

    If the command fails, raise StepFailed naming the step.
    """
    result = subprocess.run(command, stdout=stdout, stderr=stderr, check=False)
    if result.returncode != 0:
        raise StepFailed(f"{step} failed (exit status {result.returncode})")


def read_settings() -> Settings:
    """Read the settings from the environment. The Makefile exports them, with its defaults."""
    missing = [n for n in ("LLAMA_SERVER_CACHE", "LLAMA_SERVER_JOBS") if not os.environ.get(n)]
    if missing:
        sys.exit(
            f"{' and '.join(missing)} not set: run `make llama-server`, which sets them "
            "(or set them yourself)"
        )
    # The options are split as the shell would split them. The Makefile once expanded them into
    # a shell command, so quoted values keep the same meaning.
    cmake_args = shlex.split(os.environ.get("CMAKE_ARGS", "")) + shlex.split(
        os.environ.get("LLAMA_SERVER_CMAKE_ARGS", "")
    )
    return Settings(
        cache=Path(os.environ["LLAMA_SERVER_CACHE"]),
        jobs=os.environ["LLAMA_SERVER_JOBS"],
        cmake_args=cmake_args,
    )


def find_installed() -> tuple[str, Path]:
    """Step 1: the installed llama-cpp-python's version and its folder of shared libraries."""
    try:
        version = importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        sys.exit(
            f"llama-cpp-python is not installed for {sys.executable}: run `make llama-server`, "
            "which runs this script with the virtualenv's Python"
        )
    # find_spec locates the package without importing it (an import loads libllama).
    spec = importlib.util.find_spec("llama_cpp")
    assert spec is not None and spec.origin is not None, "llama_cpp is installed but not found"
    return version, Path(spec.origin).parent / "lib"


def download_sources(version: str, work: Path) -> Path:
    """Step 2: download the llama-cpp-python sdist of ``version`` into ``work``."""
    pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
    pip += [f"llama-cpp-python=={version}", "-d", str(work)]
    run_step(f"downloading the llama-cpp-python {version} sdist", pip)
    sdist = work / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        raise StepFailed(f"pip downloaded no {sdist.name} into {work}")
    return sdist


def unpack(sdist: Path, into: Path, version: str) -> Path:
    """Extract the sdist into a new folder. Return the folder of llama.cpp's sources in it."""
    into.mkdir()
    run_step(f"extracting {sdist.name}", ["tar", "-xzf", str(sdist), "-C", str(into)])
    return into / f"llama_cpp_python-{version}" / "vendor" / "llama.cpp"


def replace_lines(path: Path, line: str, replacement: str) -> None:
    """Replace every line of ``path`` that is exactly ``line``. Fail if there is none."""
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if text.rstrip("\n") == line]
    if not hits:
        raise StepFailed(f"patching {path}: no line {line.strip()!r} (llama.cpp changed)")
    for i in hits:
        lines[i] = replacement + "\n"
    path.write_text("".join(lines))


def cut_from(path: Path, line: str) -> None:
    """Delete the first line of ``path`` that is exactly ``line``, and every line after it."""
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, text in enumerate(lines) if text.rstrip("\n") == line]
    if not hits:
        raise StepFailed(f"patching {path}: no line {line!r} (llama.cpp changed)")
    path.write_text("".join(lines[: hits[0]]))


def patch_for_prebuilt(src: Path) -> None:
    """Make llama.cpp's CMake build use imported targets instead of compiling ggml, llama, mtmd."""
    top = src / "CMakeLists.txt"
    # ggml and libllama (src/) come from prebuilt.cmake, which is included where src/ was added.
    replace_lines(top, "    add_subdirectory(ggml)", "    # ggml: prebuilt")
    replace_lines(top, "add_subdirectory(src)", "include(prebuilt.cmake)")
    # The install rules come last. CMake refuses to install imported targets, and this build
    # installs nothing, so they go.
    cut_from(top, "include(GNUInstallDirs)")
    # libmtmd is prebuilt too: its imported target replaces tools/mtmd.
    replace_lines(
        src / "tools" / "CMakeLists.txt", "    add_subdirectory(mtmd)", "    # mtmd: prebuilt"
    )
    shutil.copyfile(PREBUILT_CMAKE, src / "prebuilt.cmake")


def log_tail(log: Path, lines: int = 15) -> str:
    tail = log.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in tail)


def build_linking_prebuilt(sdist: Path, version: str, lib: Path, work: Path, s: Settings) -> Path:
    """Step 3, the fast path: compile only the server, linked to llama-cpp-python's libraries.

    Return the built binary. Raise StepFailed if any step fails: then the full build follows.
    """
    for name in ("libllama.so", "libmtmd.so"):
        if not (lib / name).is_file():
            raise StepFailed(f"{lib / name} not found")
    src = unpack(sdist, work / "fast", version)
    patch_for_prebuilt(src)
    build = work / "build-fast"
    log = work / "configure.log"
    # Configure quietly: if it fails, the full build runs next, so only the end of the log
    # is shown. The $ORIGIN rpath lets the cached binary find the libraries copied next to it.
    configure = ["cmake", "-S", str(src), "-B", str(build), *s.cmake_args]
    configure += [f"-DLLAMA_PREBUILT_LIB_DIR={lib}", "-DCMAKE_BUILD_RPATH=$ORIGIN"]
    with log.open("w") as out:
        try:
            run_step(
                "configuring the server against the prebuilt libraries",
                configure,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        except StepFailed as error:
            raise StepFailed(f"{error}; the end of its log:\n{log_tail(log)}") from None
    run_step(
        "compiling the server",
        ["cmake", "--build", str(build), "--target", TARGET, "-j", s.jobs],
    )
    return build / "bin" / TARGET


def copy_libraries(lib: Path, out: Path) -> None:
    """Copy llama-cpp-python's shared libraries next to the fast-path binary.

    Symbolic links are followed, so each name becomes a file of its own.
    """
    for library in sorted(lib.glob("lib*.so*")):
        if library.is_file():
            shutil.copy(library, out / library.name)


def build_in_full(sdist: Path, version: str, work: Path, s: Settings) -> Path:
    """Step 4, the fallback: compile llama.cpp and the server from unpatched sources."""
    src = unpack(sdist, work / "full", version)
    build = work / "build-full"
    with (work / "configure.log").open("w") as log:
        # CMake's messages go to the log; its warnings and errors are shown.
        run_step(
            "configuring llama.cpp",
            ["cmake", "-S", str(src), "-B", str(build), *s.cmake_args],
            stdout=log,
        )
    run_step(
        "compiling llama.cpp and the server",
        ["cmake", "--build", str(build), "--target", TARGET, "-j", s.jobs],
    )
    return build / "bin" / TARGET


def check_runs(binary: Path) -> None:
    """Step 5a: the binary must start and answer ``--version``. This catches missing libraries
    and instructions that this CPU lacks.
    """
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        output = (result.stdout + result.stderr).strip()[-2000:]
        raise StepFailed(
            f"the built {binary} does not run: `--version` exited {result.returncode}:\n{output}"
        )


def install(binary: Path, destination: Path) -> None:
    """Step 5b: put the binary in the cache with one rename. A partial copy keeps another name."""
    partial = destination.with_name(destination.name + ".tmp")
    shutil.copy(binary, partial)
    os.replace(partial, destination)


def is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def main() -> None:
    # No options: the settings come from the environment. --help shows this docstring.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    settings = read_settings()
    version, lib = find_installed()
    out = settings.cache / version
    destination = out / TARGET
    if is_executable(destination):
        say(f"llama-server {version}: {destination}")
        return

    start = time.monotonic()
    say(
        f"building llama-server {version} (once per machine: ~11 min on 2 cores, ~21 if in full)..."
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            sdist = download_sources(version, work)
            try:
                built = build_linking_prebuilt(sdist, version, lib, work, settings)
                out.mkdir(parents=True, exist_ok=True)
                copy_libraries(lib, out)
            except StepFailed as why:
                say("linking llama-cpp-python's libraries failed: building llama.cpp in full")
                say(f"  why: {why}")
                built = build_in_full(sdist, version, work, settings)
                out.mkdir(parents=True, exist_ok=True)
            check_runs(built)
            install(built, destination)
    except StepFailed as error:
        sys.exit(f"llama-server {version} was not built: {error}")
    say(f"built llama-server {version} in {round(time.monotonic() - start)} s: {destination}")


if __name__ == "__main__":
    main()
