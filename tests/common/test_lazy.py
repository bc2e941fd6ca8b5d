"""Public names imported on first use: importing the packages loads no component."""

from __future__ import annotations

import subprocess
import sys

import pytest

ROOT = "llama_index.packs.self_rag_rse"
LIGHT = [f"{ROOT}.common", f"{ROOT}.common.lazy"]

CHECK = """
import sys
import {package} as package
loaded = sorted(m for m in sys.modules if m.startswith("{root}."))
assert loaded == {light!r}, loaded
for name in package.__all__:
    assert getattr(package, name) is getattr(package, name)
assert set(package.__all__) <= set(dir(package))
try:
    package.no_such_name
except AttributeError as error:
    assert "no_such_name" in str(error)
else:
    raise AssertionError("an unknown name must raise AttributeError")
"""


@pytest.mark.parametrize(("package", "light"), [(ROOT, LIGHT)])
def test_names_load_on_first_use(package: str, light: list[str]) -> None:
    code = CHECK.format(package=package, root=ROOT, light=sorted(light))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
