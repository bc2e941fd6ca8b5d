"""A model server the tests start on 127.0.0.1 and a free port, wait for, and stop: shared by
llama.cpp's ``llama-server`` (top conftest) and llama-cpp-python's server (tests/served).
"""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import pytest


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """``command`` running with its output in ``log``, ready once ``url + ready_path`` answers
    200 (at most 60 s, else the test fails with the log's tail).
    """

    def __init__(
        self, name: str, command: Sequence[str], url: str, ready_path: str, log: Path
    ) -> None:
        import httpx

        self.url = url
        self.log = log
        with open(log, "wb") as out:
            self.process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                pytest.fail(f"{name} exited ({self.process.returncode}):\n{self.tail()}")
            try:
                if httpx.get(f"{url}{ready_path}", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                pytest.fail(f"{name} did not answer in 60 s:\n{self.tail()}")
            time.sleep(0.1)

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
